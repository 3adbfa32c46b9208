"""Model surgery: select layers of a model, replace their mixer, freeze parts of it.

Pure functions of a ``ModelConfig`` and its parameter state (``nnx.state(model)``, or a
train state's ``"params"``); nothing is modified in place.

- ``select_layers(cfg, index=..., kind=..., where=...)``: layer indices, by index, by kind
  (the layer's mixer names, ``"+"``-joined for mixers side by side: ``"mha"``,
  ``"mha+mamba2"``) or by a predicate on ``(index, kind)``.
- ``replace_mixer(cfg, params, layers, mixer)``: a new config whose ``block_pattern`` puts
  ``mixer`` in the selected layers (the shortest prefix + repeating block that spells the
  new per-layer kinds), and new parameters. Every parameter of an untouched layer, the
  embeddings, the final norm and, in replaced layers, the norms and the FFN are copied
  exactly. A replaced layer's mixer is initialised fresh (``build_model`` of the new config
  at ``seed``); with ``init="matching"`` its parameters that the old mixer held under the
  same name and shape are copied (``mha`` -> ``sinks``, say), then those the new mixer's
  ``Mixer.inherit`` fills from the old ones (Gated DeltaNet's fused ``in_proj_qkvz`` takes
  attention's ``q/k/v`` where the head counts and widths agree).
- ``layer_mask(cfg, params, layers, part=...)``: a boolean tree like ``params`` (each leaf
  an array of its shape; stacked leaves hold several layers, so the mask is per element;
  ``broadcast=True``: of the leaf's layer axis only), True on the selected layers'
  parameters (``part="mixer"``: their mixers only).
- ``freeze(tx, mask)``: ``tx`` with its updates set to zero where ``mask`` is True, so those
  parameters stay bitwise unchanged (the complement, ``jax.tree.map(np.logical_not,
  mask)``, trains the selection only); the state is ``tx``'s own.

A run applies them from its config (``attnlab.runs.surgery_run``): ``select_from`` reads a
layer selection group (``index``, ``kind``, ``every``/``positions``) and ``freeze_mask`` the
``freeze`` group, which the ``Trainer`` wraps its optimiser with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.config.layer_kinds import BlockPattern, LayerKind, MixerSpec, stack_plan
from attnlab.contracts.mixer import get_mixer, make_settings, registered_mixers
from attnlab.errors import ConfigError
from attnlab.nn.models import build_model

STACKS = ("decoder", "encoder")  # the attribute of a one-stack model that holds its layers
MIXER = "attn"  # a block's mixer (or list of mixers side by side)
INITS = ("fresh", "matching")


def _fail(field: str, value, fix: str):
    raise ConfigError(f"surgery: {field}={value!r} is invalid: {fix}")


def _plan(cfg: ModelConfig):
    if cfg.arch == "encoder_decoder":
        _fail("cfg.arch", cfg.arch, "surgery works on one-stack models (decoder or encoder)")
    return stack_plan(cfg, cfg.n_layers)


def kind_name(kind: LayerKind) -> str:
    """A layer kind's name: its mixers' names, ``"+"``-joined when side by side."""
    return "+".join(m.mixer for m in kind.mixers)


def layer_kind_names(cfg: ModelConfig) -> tuple[str, ...]:
    """Each layer's kind name (``kind_name``), in layer order."""
    return tuple(kind_name(k) for k in _plan(cfg).kinds)


def select_layers(
    cfg: ModelConfig,
    *,
    index: int | Iterable[int] | None = None,
    kind: str | Iterable[str] | None = None,
    where: Callable[[int, str], bool] | None = None,
) -> tuple[int, ...]:
    """The layers (sorted indices) that match every criterion given: ``index`` (ints,
    negative from the end), ``kind`` (kind names, ``layer_kind_names``), ``where(index, kind)``.
    No criterion selects every layer."""
    kinds = layer_kind_names(cfg)
    n = len(kinds)
    chosen = set(range(n))
    if index is not None:
        wanted = [index] if isinstance(index, (int, np.integer)) else list(index)
        for i in wanted:
            if not isinstance(i, (int, np.integer)) or not -n <= i < n:
                _fail("index", i, f"a layer index in [-{n}, {n}) (the model has {n} layers)")
        chosen &= {int(i) % n for i in wanted}
    if kind is not None:
        wanted = {kind} if isinstance(kind, str) else set(kind)
        unknown = wanted - set(kinds)
        if unknown:
            _fail("kind", sorted(unknown)[0], f"one of the model's kinds {sorted(set(kinds))}")
        chosen &= {i for i, k in enumerate(kinds) if k in wanted}
    if where is not None:
        chosen &= {i for i, k in enumerate(kinds) if where(i, k)}
    return tuple(sorted(chosen))


def _layers(cfg, layers) -> tuple[int, ...]:
    n = cfg.n_layers
    out = []
    for i in layers:
        if not isinstance(i, (int, np.integer)) or not 0 <= i < n:
            _fail("layers", i, f"layer indices in [0, {n}) (use select_layers)")
        out.append(int(i))
    return tuple(sorted(set(out)))


def pattern_of(kinds: tuple[LayerKind, ...]) -> BlockPattern:
    """The shortest ``prefix`` + repeated ``block`` that spells ``kinds`` (ties: the
    shorter prefix)."""
    n = len(kinds)
    options = []
    for p in range(n):
        rest = kinds[p:]
        for k in range(1, len(rest) + 1):
            if len(rest) % k == 0 and rest == rest[:k] * (len(rest) // k):
                options.append((p + k, p, k))
                break
    _, p, k = min(options)
    return BlockPattern(block=kinds[p : p + k], prefix=kinds[:p])


def replaced_config(cfg: ModelConfig, layers, mixer: str, mixer_settings=None) -> ModelConfig:
    """``cfg`` with ``mixer`` in ``layers`` (its other layers unchanged); ``cfg`` itself
    when that changes nothing."""
    plan = _plan(cfg)
    layers = _layers(cfg, layers)
    if not isinstance(mixer, str) or mixer not in registered_mixers():
        _fail("mixer", mixer, f"a registered mixer; known: {sorted(registered_mixers())}")
    spec = MixerSpec(mixer, make_settings(mixer, mixer_settings))
    kinds = tuple(
        LayerKind((spec,), k.ffn_variant, k.ffn_settings) if i in layers else k
        for i, k in enumerate(plan.kinds)
    )
    if kinds == plan.kinds:
        return cfg
    changes = {"block_pattern": pattern_of(kinds)}
    if getattr(cfg.ffn_settings, "dense_layers", 0):  # now spelled out by the pattern
        changes["ffn_settings"] = dataclasses.replace(cfg.ffn_settings, dense_layers=0)
    new = cfg.replace(**changes)
    new.block_pattern.validate(new)
    return new


def _where(plan, i: int):
    """Layer ``i``'s place in the stack's tree: ``(path, row)``."""
    for s in plan.segments:
        if s.first <= i < s.first + s.n_layers:
            r, p = divmod(i - s.first, len(s.kinds))
            return ((s.attr,) if len(s.kinds) == 1 else (s.attr, "blocks", p)), r
    raise AssertionError(i)


def _leaves(tree, path=()):
    """``{path: leaf}`` of a nested dict."""
    if not isinstance(tree, dict):
        return {path: tree}
    out = {}
    for k, v in tree.items():
        out.update(_leaves(v, path + (k,)))
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _stack(pure: dict) -> str:
    for name in STACKS:
        if name in pure:
            return name
    raise AssertionError(sorted(pure))


def replace_mixer(
    cfg: ModelConfig,
    params,
    layers,
    mixer: str,
    mixer_settings=None,
    *,
    init: str = "fresh",
    seed: int = 0,
):
    """``(new_cfg, new_params)``: ``mixer`` (with ``mixer_settings``) in ``layers``
    (module docstring: what is copied, what is fresh)."""
    if init not in INITS:
        _fail("init", init, f"one of {INITS}")
    new_cfg = replaced_config(cfg, layers, mixer, mixer_settings)
    layers = _layers(cfg, layers)
    old_plan, new_plan = _plan(cfg), _plan(new_cfg)
    old = nnx.to_pure_dict(params)
    state = nnx.state(build_model(new_cfg, seed=seed))
    new = nnx.to_pure_dict(state)
    name = _stack(old)
    for key in old:  # embeddings, head: everything outside the stack
        if key != name:
            new[key] = old[key]
    layer_attrs = {s.attr for plan in (old_plan, new_plan) for s in plan.segments}
    for key in old[name]:
        if key not in layer_attrs:  # norms, positions
            new[name][key] = old[name][key]
    # Rows are copied in NumPy (on the host, exactly): no program per leaf shape.
    host = {s.attr: jax.tree.map(np.array, new[name][s.attr]) for s in new_plan.segments}
    new[name].update(host)
    old_host = {s.attr: jax.tree.map(np.asarray, old[name][s.attr]) for s in old_plan.segments}
    for i in range(cfg.n_layers):
        (src, r), (dst, q) = _where(old_plan, i), _where(new_plan, i)
        src_leaves = _leaves(_get(old_host, src))
        dst_tree = _get(new[name], dst)
        for path, a in _leaves(dst_tree).items():
            b = src_leaves.get(path)
            fresh = i in layers and path[0] == MIXER
            if fresh and (init == "fresh" or b is None or b.shape[1:] != a.shape[1:]):
                continue
            a[q] = b[r]
        if i in layers and init == "matching":
            _inherit(new_plan.kinds[i], new_cfg, src_leaves, dst_tree, r, q)
    new[name].update(jax.tree.map(jnp.asarray, host))
    nnx.replace_by_pure_dict(state, new)
    return new_cfg, state


def _inherit(kind: LayerKind, cfg, src_leaves, dst_tree, r: int, q: int):
    """The new mixer's ``Mixer.inherit`` of the old layer's mixer parameters (row ``r``)
    into row ``q`` of the new layer (one mixer in each)."""
    if len(kind.mixers) != 1 or not isinstance(dst_tree.get(MIXER), dict):
        return
    spec = kind.mixers[0]
    old = {p[1]: np.asarray(a[r]) for p, a in src_leaves.items() if len(p) == 2 and p[0] == MIXER}
    mixer = dst_tree[MIXER]
    new = {k: np.asarray(a[q]) for k, a in mixer.items() if not isinstance(a, dict)}
    got = get_mixer(spec.mixer).inherit(cfg, spec.mixer_settings, old, new)
    for k, value in got.items():
        mixer[k][q] = np.asarray(value, mixer[k].dtype)


def layer_mask(cfg: ModelConfig, params, layers, *, part: str = "layer", broadcast=False):
    """True on the parameters of ``layers`` (``part="mixer"``: their mixers only), False
    elsewhere: a tree like ``params`` with a boolean array of each leaf's shape (with
    ``broadcast``, of its leading axis only, the others 1: what broadcasts against the
    leaf, a constant the size of the stack rather than of the model)."""
    if part not in ("layer", "mixer"):
        _fail("part", part, "'layer' (the whole layer) or 'mixer'")
    plan, layers = _plan(cfg), _layers(cfg, layers)
    pure = nnx.to_pure_dict(params)
    shape = lambda a: np.shape(a)[:1] + (1,) * (len(np.shape(a)) - 1) if broadcast else np.shape(a)
    mask = jax.tree.map(lambda a: np.zeros(shape(a), bool), pure)
    name = _stack(pure)
    for i in layers:
        at, r = _where(plan, i)
        for path, m in _leaves(_get(mask[name], at)).items():
            if part == "layer" or path[0] == MIXER:
                m[r] = True
    state = jax.tree.map(lambda a: a, params)  # a copy of the structure
    nnx.replace_by_pure_dict(state, mask)
    return state


def zero_frozen(tree, mask):
    """``tree`` (gradients or updates) with zeros where ``mask`` (``layer_mask``) is True."""
    return jax.tree.map(lambda u, m: jnp.where(m, jnp.zeros_like(u), u), tree, mask)


def freeze(tx: optax.GradientTransformation, mask) -> optax.GradientTransformation:
    """``tx`` seeing zero gradients where ``mask`` (``layer_mask``) is True, as if those
    parameters had none (its clipping's global norm is the trained parameters' alone), and
    its updates set to zero there (weight decay and momentum would move them). The state
    is ``tx``'s own (it still tracks the frozen parameters), so a checkpoint restores with
    or without freezing; ``optax.apply_updates`` adds 0, which keeps every value but turns
    a -0.0 into 0.0."""

    def update(updates, state, params=None):
        updates, state = tx.update(zero_frozen(updates, mask), state, params)
        return zero_frozen(updates, mask), state

    return optax.GradientTransformation(tx.init, update)


# Config groups (``attnlab.experiment.schema.layer_selection``, ``freeze``) ----------------
FREEZE_MODES = ("none", "selected", "others")


def _config_fail(field: str, value, fix: str):
    raise ConfigError(f"{field}={value!r} is invalid: {fix}; set --config.{field}=...")


def select_from(cfg: ModelConfig, group, field: str) -> tuple[int, ...]:
    """The layers a config's layer selection (``index``, ``kind``, ``every`` and
    ``positions``) picks in ``cfg``; ``field`` (``"surgery.layers"``) names it in errors."""
    kinds, n = layer_kind_names(cfg), cfg.n_layers
    index, kind = tuple(group.get("index") or ()), str(group.get("kind") or "")
    every, positions = int(group.get("every") or 0), tuple(group.get("positions") or ())
    for i in index:
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            _config_fail(f"{field}.index", i, f"layer indices in [-{n}, {n}) ({n} layers)")
    if kind and kind not in kinds:
        _config_fail(f"{field}.kind", kind, f"one of the model's kinds {sorted(set(kinds))}")
    if every < 0 or (positions and not every):
        _config_fail(f"{field}.every", every, "a period > 0 for positions (0: no period)")
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < every:
            _config_fail(f"{field}.positions", p, f"positions in [0, every={every})")
    return select_layers(
        cfg,
        index=index or None,
        kind=kind or None,
        where=(lambda i, _k: i % every in positions) if every else None,
    )


def freeze_mask(cfg: ModelConfig, group, params):
    """The ``freeze`` config group's broadcast ``layer_mask`` over ``params`` (True: kept
    unchanged), or None when ``mode="none"``; ``"others"`` freezes every parameter outside
    the selection (embeddings and final norm included)."""
    chosen = check_freeze(cfg, group)
    if chosen is None:
        return None
    mask = layer_mask(cfg, params, chosen, part=group.part, broadcast=True)
    return mask if group.mode == "selected" else jax.tree.map(np.logical_not, mask)


def check_freeze(cfg: ModelConfig, group) -> tuple[int, ...] | None:
    """The layers the ``freeze`` group selects (None for ``mode="none"``); one-line
    errors name its field."""
    mode, part = group.get("mode", "none"), group.get("part", "layer")
    if mode not in FREEZE_MODES:
        _config_fail("freeze.mode", mode, f"one of {FREEZE_MODES}")
    if part not in ("layer", "mixer"):
        _config_fail("freeze.part", part, "'layer' (the whole layer) or 'mixer'")
    if mode == "none":
        return None
    if cfg.arch == "encoder_decoder":
        _config_fail("freeze.mode", mode, "'none': freezing selects layers of one-stack models")
    return select_from(cfg, group.layers, "freeze.layers")
