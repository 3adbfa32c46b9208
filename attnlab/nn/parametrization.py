"""Each parameter's role and multipliers for ``ModelConfig.parametrization``, read from the
model's parameter shapes (the rules, the roles and the forward multipliers are
``attnlab.config.parametrization``, whose names this module also carries)."""

from __future__ import annotations

import functools
import math

import jax

from attnlab.config.parametrization import (  # noqa: F401  (re-exported)
    ELEMENTWISE,
    PARAMETRIZATIONS,
    ROLES,
    RULES,
    Scale,
    _adam,
    _muon,
    _sgd,
    attention_scale,
    check,
    depth_base,
    is_standard,
    readout_multiplier,
    residual_multiplier,
    scale_tree,
    scale_updates,
    standard_equivalent,
    width_base,
)
from attnlab.errors import ConfigError
from attnlab.nn.registry import MODEL_CLASSES


def _suffix(path) -> tuple[str, str]:
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    name = next(k for k in reversed(keys) if k not in ("value", "raw_value"))
    return name, name.rsplit("_", 1)[-1] if "_" in name else ""


def _axes(path, shape, stacked: bool):
    """(input axes, output axes) of a weight, after its stack's leading layer axis."""
    name, suffix = _suffix(path)
    axes = tuple(range(int(stacked), len(shape)))
    if len(axes) < 2:
        return axes, ()
    if suffix.startswith("D"):
        return axes[:1], axes[1:]
    return axes[:-1], axes[-1:]


def _abstract(cfg):
    """The parameter shapes of ``cfg``'s model and the roles its modules declare."""
    from flax import nnx

    model = nnx.eval_shape(lambda: MODEL_CLASSES[cfg.arch](cfg, rngs=nnx.Rngs(0)))
    declared = {}
    for _, node in nnx.iter_graph(model):
        declared.update(getattr(type(node), "parameter_roles", {}) or {})
    return nnx.state(model, nnx.Param), declared


def _at_width(cfg, width: int):
    return cfg.replace(parametrization="standard", base_width=None, base_depth=None,
                       d_model=width)  # fmt: skip


@functools.lru_cache(maxsize=32)
def scales(cfg):
    """A tree like the model's parameters (``nnx.State``) of their ``Scale``s."""
    from attnlab.contracts.optimizer import muon_dimensions
    from attnlab.devices.sharding import stacked_path

    base_w = width_base(cfg)
    try:
        base_cfg, probe_cfg = _at_width(cfg, base_w), _at_width(cfg, 2 * base_w)
    except ConfigError as e:
        raise ConfigError(
            f"ModelConfig.base_width={base_w} is invalid: the model at that width is not: {e}"
        ) from None
    params, declared = _abstract(cfg)
    base, _ = _abstract(base_cfg)
    probe, _ = _abstract(probe_cfg)
    muon = muon_dimensions(params)

    def read(path, x, b, p, mu):
        if x.ndim != b.ndim:
            raise ConfigError(
                f"ModelConfig.base_width={base_w}: {jax.tree_util.keystr(path)} has another "
                f"number of axes at the base width ({b.shape} against {x.shape})"
            )
        name, _ = _suffix(path)
        ins, outs = _axes(path, x.shape, stacked_path(path))
        grows = lambda axes: any(p.shape[a] != b.shape[a] for a in axes)
        size = lambda shape, axes: math.prod(shape[a] for a in axes)
        role = declared.get(name)
        if role is None:
            if not outs or any(w in name.rsplit("_", 1)[0] for w in ELEMENTWISE):
                role = "vector"
            elif grows(ins) and grows(outs):
                role = "hidden"
            elif grows(ins):
                role = "readout"
            elif grows(outs):
                role = "input"
            else:
                role = "vector"
        if role not in ROLES:
            raise ConfigError(f"parameter_roles[{name!r}]={role!r}: use one of {list(ROLES)}")
        if not outs:  # a vector: its one axis counts as its output
            ins, outs = (), ins
        return Scale(
            role, size(x.shape, ins), size(x.shape, outs), size(b.shape, ins),
            size(b.shape, outs), mu is not None,
        )  # fmt: skip

    return jax.tree_util.tree_map_with_path(read, params, base, probe, muon)


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, Scale))


def init_multipliers(cfg):
    """A tree of floats like the parameters: each one's initialisation multiplier (all 1.0
    for the standard parametrisation)."""
    table = scales(cfg)
    return jax.tree.map(lambda s: s.init, table, is_leaf=lambda v: isinstance(v, Scale))


def lr_multipliers(cfg, rule: str):
    """A tree of floats like the parameters: each one's learning-rate multiplier under
    ``RULES[rule]``."""
    table = scales(cfg)
    return jax.tree.map(RULES[rule], table, is_leaf=lambda v: isinstance(v, Scale))


def table(cfg, rule: str | None = None) -> list[dict]:
    """Each parameter's path, role, fans and multipliers, for reading and for reports."""
    rows = []
    lrs = _leaves(lr_multipliers(cfg, rule)) if rule else None
    flat = jax.tree_util.tree_flatten_with_path(
        scales(cfg), is_leaf=lambda v: isinstance(v, Scale)
    )[0]
    for i, (path, s) in enumerate(flat):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        path = ".".join(k for k in keys if k not in ("value", "raw_value"))
        row = {"path": path, "role": s.role, "fan_in": s.fan_in, "fan_out": s.fan_out}
        row["init"] = s.init
        if lrs is not None:
            row["lr"] = lrs[i]
        rows.append(row)
    return rows


def to_standard(model):
    """``model`` (any architecture) as a standard-parametrisation model computing the same
    function, the form Hugging Face checkpoints take: the read-out multiplier folded into
    an untied head (``head_DV``), the 1/d attention's extra factor folded into the query
    projections of plain ``mha`` layers without QK-norm, the rest written out as fields
    (``standard_equivalent``). Folding is exact when the factors are powers of two (widths
    a power-of-four multiple of the base); otherwise it rounds once per weight."""
    from flax import nnx

    cfg = model.cfg
    if is_standard(cfg):
        return model
    changes = {}
    readout = readout_multiplier(cfg)
    params = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(params)
    if not cfg.tie_embeddings and readout != 1.0:
        pure["head"]["head_DV"] = pure["head"]["head_DV"] * readout
        changes["logits_scale"] = cfg.logits_scale
    head_dim_scale = cfg.head_dim**-0.5
    plain = cfg.mixer == "mha" and cfg.block_pattern is None and not cfg.qk_norm
    if plain and cfg.attn_scale != head_dim_scale and cfg.arch == "decoder":
        ratio = cfg.attn_scale / head_dim_scale
        attn = pure["decoder"]["layers"]["attn"]
        for name in ("q_DNH", "q_bias_NH"):
            if name in attn:
                attn[name] = attn[name] * ratio
        changes["attn_scale"] = None
    std = standard_equivalent(cfg).replace(**changes)
    out = nnx.eval_shape(lambda: MODEL_CLASSES[std.arch](std, rngs=nnx.Rngs(0)))
    state = nnx.state(out, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(out, state)
    return out
