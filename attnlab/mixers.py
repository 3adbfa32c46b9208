"""The variant contract: a sequence mixer (an attention variant, later a recurrent layer) is a
registered Flax NNX module that owns its parameters, names its settings and declares what it
keeps in the cache.

A variant supplies, in one class::

    @attnlab.register_mixer("sinks")
    class Sinks(attnlab.Mixer):
        @dataclasses.dataclass(frozen=True)
        class Settings(attnlab.MixerSettings):   # validated, errors name the field
            init: float = 0.0

        def __init__(self, cfg, settings, *, rngs): ...        # parameters (shape-suffixed)

        @classmethod
        def cache_entries(cls, cfg, settings): ...             # {"keys": CacheEntry, ...}

        def __call__(self, x_BTD, call: MixerCall): ...        # -> (out_BTD, cache, weights)

``ModelConfig(mixer="sinks", mixer_settings={"init": 1.0})`` then builds it in every
self-attention layer of every architecture; nothing in the library tests for the name.

The call. ``MixerCall`` holds what one layer's call needs besides ``x_BTD``: the query
positions, the mask (one ``ops.MaskSpec``: queries' and keys' positions and the rules;
``mask.dense()`` gives the array; a ``ContextMask`` when the sequence is split over the
mesh), the position bias description (``ops.PositionBias`` or None), the layer's RoPE base,
the dropout key, whether weights are asked for and, when decoding, the layer's cache
(``kv_cache.LayerCache``). Without a cache the call is training or a plain forward pass;
with one it is a prefill (T tokens) or a decode step (T = 1), and the variant appends its
per-token entries (``cache.append``) or replaces its fixed-size state (``cache.put``), then
returns the new ``LayerCache``. A variant whose decode step differs from its prefill (a
recurrence) tests ``call.cache is not None and x_BTD.shape[1] == 1``.

The cache contract. ``cache_entries`` maps each entry's role (``"keys"``, ``"values"``,
``"latent"``, ``"state"``, ``"conv"``...) to a ``CacheEntry``: its per-row shape, with
``SLOTS`` on the token axis of a per-token entry (keys, values, a compressed latent) or no
token axis at all for fixed-size state (a recurrent or convolution state); its dtype (None:
the cache's) and the logical axes that shard it. The cache stores each entry as
``[L, B, *shape]``; per-token entries are written at each row's slots (linear or ring
buffer), state entries replaced whole. ``kv_cache_bytes`` sums the entries, so a variant's
cache size follows from its config alone.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
from flax import nnx, struct

from attnlab.errors import ConfigError

SLOTS = -1  # the token axis of a per-token cache entry, sized when the cache is built


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One role a variant keeps per layer in the cache (see the module docstring)."""

    shape: tuple[int, ...]
    dtype: str | None = None  # None: the cache's dtype (the model's compute dtype)
    axes: tuple[str | None, ...] | None = None  # logical axes of ``shape`` (None: replicated)

    @property
    def slot_axis(self) -> int | None:
        """Index of the token axis in ``shape``, or None for fixed-size state."""
        return self.shape.index(SLOTS) if SLOTS in self.shape else None

    def sized(self, slots: int) -> tuple[int, ...]:
        """The per-row shape with ``SLOTS`` replaced by ``slots``."""
        return tuple(slots if d == SLOTS else d for d in self.shape)


@dataclasses.dataclass(frozen=True)
class MixerSettings:
    """Base of a variant's settings: a frozen dataclass of plain values (JSON-able)."""

    def validate(self, cfg) -> None:
        """Raises ``ConfigError`` (``self.fail``) for values that do not fit ``cfg``."""

    def fail(self, field: str, fix: str):
        """Raises a ``ConfigError`` naming ``mixer_settings.<field>``, its value and ``fix``."""
        raise ConfigError(
            f"ModelConfig.mixer_settings.{field}={getattr(self, field)!r} is invalid: {fix}"
        )

    def to_dict(self) -> dict:
        """The settings as a plain, JSON-able dict."""
        return dataclasses.asdict(self)


@struct.dataclass
class MixerCall:
    """Everything but ``x_BTD`` that one layer's mixer call receives."""

    positions_BT: jax.Array
    mask: Any = None  # ops.MaskSpec (or a ContextMask on a context-parallel mesh)
    bias: Any = None  # ops.PositionBias or None
    rope_theta: Any = None  # this layer's RoPE base (traced inside the scan over layers)
    cache: Any = None  # kv_cache.LayerCache while decoding, else None
    key: jax.Array | None = None  # dropout key (None: no dropout)
    layer: Any = None  # the layer's index in its stack (int32, traced inside the scan)
    return_weights: bool = struct.field(pytree_node=False, default=False)

    @property
    def decoding(self) -> bool:
        """Whether the call holds a cache (a prefill or a decode step)."""
        return self.cache is not None


class Mixer(nnx.Module):
    """Base class of sequence-mixing variants (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    Settings: ClassVar[type[MixerSettings]] = MixerSettings
    # Whether the variant's maths is softmax attention over K/V blocks, so the stack may
    # hand it a sequence split over the mesh's context axis (a ``ContextMask``).
    context_parallel: ClassVar[bool] = False

    @classmethod
    def cache_entries(cls, cfg, settings) -> dict[str, CacheEntry]:
        """What one layer keeps in the cache: role -> ``CacheEntry`` (the default: nothing,
        so the variant cannot decode)."""
        raise NotImplementedError(f"mixer {cls.name!r} keeps no cache: it cannot decode")

    def __call__(self, x_BTD, call: MixerCall):
        raise NotImplementedError


_REGISTRY: dict[str, type[Mixer]] = {}
# The built-in variants, imported on first use (each registers itself).
_BUILTINS = {
    "mha": "attnlab.nn.attention",
    "sinks": "attnlab.nn.mixers.sinks",
    "gated": "attnlab.nn.mixers.gated",
    "differential": "attnlab.nn.mixers.differential",
    "mla": "attnlab.nn.mixers.mla",
}


def _load_builtins():
    for module in _BUILTINS.values():
        importlib.import_module(module)


def register_mixer(name: str, cls: type[Mixer] | None = None, *, overwrite: bool = False):
    """Registers ``cls`` as ``ModelConfig(mixer=name)``; usable as a class decorator."""

    def register(cls):
        if not isinstance(name, str) or not name:
            raise TypeError(f"register_mixer: the name must be a non-empty str, got {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, Mixer)):
            raise TypeError(f"register_mixer({name!r}): {cls!r} is not a subclass of Mixer")
        settings = cls.Settings
        ok = isinstance(settings, type) and issubclass(settings, MixerSettings)
        if not (ok and dataclasses.is_dataclass(settings) and settings.__dataclass_params__.frozen):
            raise TypeError(
                f"mixer {name!r}: its Settings must be a frozen MixerSettings dataclass"
            )
        if name in _REGISTRY and not overwrite and _REGISTRY[name] is not cls:
            raise ValueError(f"mixer {name!r} exists; pass overwrite=True to replace it")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register if cls is None else register(cls)


def registered_mixers() -> dict[str, type[Mixer]]:
    """Every registered variant by name (the built-ins included)."""
    _load_builtins()
    return dict(_REGISTRY)


def get_mixer(name: str) -> type[Mixer]:
    if name not in _REGISTRY and name in _BUILTINS:
        importlib.import_module(_BUILTINS[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        _load_builtins()
        raise ConfigError(
            f"ModelConfig.mixer={name!r} is not registered: register it with "
            f"attnlab.register_mixer first; known: {sorted(_REGISTRY)}"
        ) from None


def make_settings(name: str, value) -> MixerSettings:
    """``value`` (None, a mapping or the variant's Settings) as mixer ``name``'s Settings."""
    settings_cls = get_mixer(name).Settings
    if value is None:
        return settings_cls()
    if isinstance(value, settings_cls):
        return value
    if isinstance(value, MixerSettings):
        raise ConfigError(
            f"ModelConfig.mixer_settings is a {type(value).__name__}, but mixer={name!r} takes "
            f"{settings_cls.__name__}: pass that, a dict of its fields, or None"
        )
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"ModelConfig.mixer_settings={value!r} is invalid: pass a dict of "
            f"{settings_cls.__name__}'s fields, or None for the defaults"
        )
    fields = {f.name: f for f in dataclasses.fields(settings_cls)}
    # A field left None means "the default" in any variant's settings: one carried over from
    # the variant a config held before (a sweep changing model.mixer) is dropped.
    value = {k: v for k, v in value.items() if k in fields or v is not None}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(
            f"ModelConfig.mixer_settings has unknown field(s) {unknown} for mixer={name!r}; "
            f"its fields are {sorted(fields)}"
        )
    return settings_cls(**{k: _hashable(v) for k, v in value.items()})


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
