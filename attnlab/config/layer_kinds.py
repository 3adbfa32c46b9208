"""Hybrid stacks: which kind of layer sits where (``ModelConfig.block_pattern``), and the plan
that the stack and the cache read from it.

A ``BlockPattern`` is an optional ``prefix`` of layer kinds followed by a ``block`` of kinds
repeated to fill the stack (``repeats = (n_layers - len(prefix)) / len(block)``)::

    ModelConfig(n_layers=12, block_pattern={
        "block": ["sinks", "sinks", "sinks", {"mixer": "mla", "mixer_settings": {...}}],
    })

A ``LayerKind`` names its sequence mixers (``attnlab.contracts.mixer``) with their own settings (a
plain name, ``{"mixer": ..., "mixer_settings": ...}``, or ``{"mixers": [...]}`` for mixers
run side by side on the same input whose outputs are summed, as Falcon-H1's attention and
Mamba-2) and optionally its own FFN (``ffn_variant``/``ffn_settings``; ``"dense"`` is the
plain FFN of DeepSeek's first layers). A kind that names no mixer takes
``ModelConfig.mixer``; one that names no FFN takes ``ModelConfig.ffn_variant``.

Without a pattern the stack is the special case of a one-kind block: the config's mixer in
every layer, after the FFN variant's dense prefix (``FFN.prefix_layers``).

``stack_plan(cfg, n_layers)`` resolves it: the stack's ``Segment``s (the prefix, then the
block; a segment whose kinds are all one kind is a plain stack of one block a layer, so a
homogeneous stack keeps its layout) and the cache layout. The cache: layers whose mixers are
the same (name and settings) share one array per role, stacked over those layers in order
(``[n, B, *shape]``); with one such mixer in the whole stack the arrays are named by role
alone (``"keys"``: the homogeneous layout), otherwise ``"<tag>.<role>"`` with the tag the
mixer's name (``"mla.latent"``, ``"sinks.keys"``; a second configuration of the same mixer
is ``"<name>_1"``). Each layer's mixer writes at its ordinal among the layers that share
the arrays, so one kind's state never sits in another's slot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from attnlab.contracts.ffn import FFNSettings, get_ffn, make_ffn_settings, registered_ffns
from attnlab.contracts.mixer import (
    CacheEntry,
    MixerSettings,
    get_mixer,
    make_settings,
    registered_mixers,
)
from attnlab.errors import ConfigError

FIELD = "block_pattern"


def _fail(where: str, value, fix: str):
    raise ConfigError(f"ModelConfig.{FIELD}.{where}={value!r} is invalid: {fix}")


def _settings(make, name, value, where):
    """``make(name, value)`` with its error moved under ``block_pattern.<where>``."""
    try:
        return make(name, value)
    except ConfigError as e:
        raise ConfigError(f"ModelConfig.{FIELD}.{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class MixerSpec:
    """One registered mixer with its settings."""

    mixer: str
    mixer_settings: MixerSettings

    @classmethod
    def of(cls, value, where: str) -> MixerSpec:
        if isinstance(value, MixerSpec):
            return value
        if isinstance(value, str):
            value = {"mixer": value}
        if not isinstance(value, Mapping) or set(value) - {"mixer", "mixer_settings"}:
            _fail(where, value, "a mixer name or {'mixer': NAME, 'mixer_settings': {...}}")
        name = value.get("mixer")
        if not isinstance(name, str) or name not in registered_mixers():
            _fail(
                f"{where}.mixer",
                name,
                f"name a registered mixer (attnlab.register_mixer); known: "
                f"{sorted(registered_mixers())}",
            )
        settings = _settings(make_settings, name, value.get("mixer_settings"), where)
        return cls(name, settings)

    def to_dict(self) -> dict:
        return {"mixer": self.mixer, "mixer_settings": self.mixer_settings.to_dict()}


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One kind of layer: its mixers (summed when several; none: ``ModelConfig.mixer``) and
    its FFN variant (None: ``ModelConfig.ffn_variant``)."""

    mixers: tuple[MixerSpec, ...] = ()
    ffn_variant: str | None = None
    ffn_settings: FFNSettings | None = None

    @classmethod
    def of(cls, value, where: str) -> LayerKind:
        if isinstance(value, LayerKind):
            return value
        if isinstance(value, str):
            value = {"mixer": value}
        keys = {"mixer", "mixer_settings", "mixers", "ffn_variant", "ffn_settings"}
        if not isinstance(value, Mapping) or set(value) - keys:
            _fail(where, value, f"a mixer name or a dict of {sorted(keys)}")
        if "mixers" in value and ({"mixer", "mixer_settings"} & set(value)):
            _fail(where, value, "give 'mixers' (side by side) or 'mixer', not both")
        if "mixers" in value:
            listed = value["mixers"]
            if not isinstance(listed, (list, tuple)) or not listed:
                _fail(f"{where}.mixers", listed, "a non-empty list of mixers, summed")
            mixers = tuple(MixerSpec.of(m, f"{where}.mixers[{i}]") for i, m in enumerate(listed))
        elif "mixer" in value:
            mixers = (MixerSpec.of({k: value[k] for k in ("mixer", "mixer_settings") if k in value},
                                   where),)  # fmt: skip
        else:
            mixers = ()
        ffn, ffn_settings = value.get("ffn_variant"), None
        if ffn is not None:
            if not isinstance(ffn, str) or ffn not in registered_ffns():
                _fail(f"{where}.ffn_variant", ffn, f"one of {sorted(registered_ffns())}")
            ffn_settings = _settings(make_ffn_settings, ffn, value.get("ffn_settings"), where)
        elif value.get("ffn_settings") is not None:
            _fail(f"{where}.ffn_settings", value["ffn_settings"], "name its ffn_variant too")
        return cls(mixers, ffn, ffn_settings)

    def resolved(self, cfg) -> LayerKind:
        """The kind with the config's mixer and FFN where it names none."""
        mixers = self.mixers or (MixerSpec(cfg.mixer, cfg.mixer_settings),)
        if self.ffn_variant is None:
            return LayerKind(mixers, cfg.ffn_variant, cfg.ffn_settings)
        return LayerKind(mixers, self.ffn_variant, self.ffn_settings)

    def to_dict(self) -> dict:
        out = {}
        if len(self.mixers) == 1:
            out.update(self.mixers[0].to_dict())
        elif self.mixers:
            out["mixers"] = [m.to_dict() for m in self.mixers]
        if self.ffn_variant is not None:
            out["ffn_variant"] = self.ffn_variant
            out["ffn_settings"] = self.ffn_settings.to_dict()
        return out


@dataclasses.dataclass(frozen=True)
class BlockPattern:
    """A stack as ``prefix`` kinds, then the ``block`` of kinds repeated (module docstring)."""

    block: tuple[LayerKind, ...]
    prefix: tuple[LayerKind, ...] = ()

    @classmethod
    def of(cls, value) -> BlockPattern | None:
        """``value`` as a pattern; None for none, or a dict whose block and prefix are
        unset (an experiment's default)."""
        if isinstance(value, BlockPattern) or value is None:
            return value
        if not isinstance(value, Mapping) or set(value) - {"prefix", "block"}:
            raise ConfigError(
                f"ModelConfig.{FIELD}={value!r} is invalid: a dict {{'block': [kinds], "
                "'prefix': [kinds]}} (prefix optional)"
            )
        if value.get("block") is None and not value.get("prefix"):
            return None
        parts = {}
        for part in ("prefix", "block"):
            kinds = value.get(part)
            kinds = () if part == "prefix" and kinds is None else kinds
            if not isinstance(kinds, (list, tuple)) or (part == "block" and not kinds):
                _fail(part, kinds, "a list of layer kinds" + (" (non-empty)" * (part == "block")))
            parts[part] = tuple(LayerKind.of(k, f"{part}[{i}]") for i, k in enumerate(kinds))
        return cls(**parts)

    def to_dict(self) -> dict:
        return {
            "prefix": [k.to_dict() for k in self.prefix],
            "block": [k.to_dict() for k in self.block],
        }

    def validate(self, cfg) -> None:
        """Checks what needs the whole config: every stack's layer count, the settings."""
        stacks = {"n_layers": cfg.n_layers}
        if cfg.arch == "encoder_decoder":
            raise ConfigError(
                f"ModelConfig.{FIELD} is set, but arch='encoder_decoder' has two stacks: "
                "hybrid stacks are for decoder or encoder models; set it None"
            )
        if getattr(cfg.ffn_settings, "dense_layers", 0):
            raise ConfigError(
                f"ModelConfig.ffn_settings.dense_layers={cfg.ffn_settings.dense_layers} is "
                f"invalid with a {FIELD}: write the dense layers as its prefix "
                "({'ffn_variant': 'dense'} kinds) and set dense_layers=0"
            )
        P, K = len(self.prefix), len(self.block)
        for field, n in stacks.items():
            if n <= P or (n - P) % K:
                _fail(
                    "block",
                    f"{K} kinds",
                    f"{field}={n} must be len(prefix)={P} plus a positive multiple of the "
                    f"block's {K} layers; change {field} or the block",
                )
        for part in ("prefix", "block"):
            for i, kind in enumerate(getattr(self, part)):
                k = kind.resolved(cfg)
                for j, m in enumerate(k.mixers):
                    where = f"{part}[{i}]" + (f".mixers[{j}]" if len(k.mixers) > 1 else "")
                    _settings(lambda _n, s, cfg=cfg: s.validate(cfg), m.mixer, m.mixer_settings,
                              where)  # fmt: skip
                _settings(lambda _n, s, cfg=cfg: s.validate(cfg), k.ffn_variant, k.ffn_settings,
                          f"{part}[{i}]")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive layers applied by one scan: ``kinds`` (P of them) in order, repeated
    ``repeats`` times from layer ``first``; the stack holds its parameters in ``attr``."""

    attr: str
    kinds: tuple[LayerKind, ...]
    repeats: int
    first: int

    @property
    def n_layers(self) -> int:
        return len(self.kinds) * self.repeats


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """The layers' mixers that share the cache arrays ``<tag>.<role>``: ``count`` of them."""

    tag: str
    spec: MixerSpec
    count: int


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """A stack resolved from its config (module docstring)."""

    segments: tuple[Segment, ...]
    kinds: tuple[LayerKind, ...]  # each layer's, resolved
    groups: tuple[CacheGroup, ...]
    # Per layer, per mixer: (group index, ordinal among the group's layers).
    slots: tuple[tuple[tuple[int, int], ...], ...]

    def names(self, group: int, cfg) -> dict[str, str]:
        """Role -> the cache's name for the entries of group ``group``."""
        g = self.groups[group]
        roles = get_mixer(g.spec.mixer).cache_entries(cfg, g.spec.mixer_settings)
        one = len(self.groups) == 1
        return {role: role if one else f"{g.tag}.{role}" for role in roles}

    def cache_layout(self, cfg) -> dict[str, tuple[CacheEntry, int]]:
        """Name -> (the entry, how many layers stack it)."""
        out = {}
        for i, g in enumerate(self.groups):
            entries = get_mixer(g.spec.mixer).cache_entries(cfg, g.spec.mixer_settings)
            for role, name in self.names(i, cfg).items():
                out[name] = (entries[role], g.count)
        return out

    @property
    def mixer_specs(self) -> tuple[MixerSpec, ...]:
        return tuple(g.spec for g in self.groups)


def _segment(attr, kinds, repeats, first) -> Segment:
    if len(set(kinds)) == 1:  # one kind: a plain stack, one block a layer
        return Segment(attr, kinds[:1], repeats * len(kinds), first)
    return Segment(attr, kinds, repeats, first)


def stack_plan(cfg, n_layers: int) -> StackPlan:
    """The segments and cache groups of a stack of ``n_layers`` layers of ``cfg``."""
    return _plan(cfg, n_layers)


@functools.lru_cache(maxsize=64)
def _plan(cfg, n_layers: int) -> StackPlan:
    pattern = cfg.block_pattern
    if pattern is None:
        kind = LayerKind().resolved(cfg)
        n_prefix = get_ffn(cfg.ffn_variant).prefix_layers(cfg, cfg.ffn_settings)
        dense = LayerKind(kind.mixers, "dense", make_ffn_settings("dense", None))
        prefix, block = (dense,) * n_prefix, (kind,)
    else:
        prefix = tuple(k.resolved(cfg) for k in pattern.prefix)
        block = tuple(k.resolved(cfg) for k in pattern.block)
    repeats = (n_layers - len(prefix)) // len(block)
    segments = (_segment("prefix", prefix, 1, 0),) if prefix else ()
    segments += (_segment("layers", block, repeats, len(prefix)),)
    kinds = prefix + block * repeats
    specs, counts, slots = [], [], []
    for kind in kinds:
        layer = []
        for spec in kind.mixers:
            if spec not in specs:
                specs.append(spec)
                counts.append(0)
            g = specs.index(spec)
            layer.append((g, counts[g]))
            counts[g] += 1
        slots.append(tuple(layer))
    tags = []
    for spec in specs:
        same = sum(s.mixer == spec.mixer for s in specs[: len(tags)])
        tags.append(spec.mixer if same == 0 else f"{spec.mixer}_{same}")
    groups = tuple(CacheGroup(t, s, c) for t, s, c in zip(tags, specs, counts, strict=True))
    return StackPlan(segments, kinds, groups, tuple(slots))
