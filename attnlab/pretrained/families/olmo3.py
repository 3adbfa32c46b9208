"""OLMo 3: OLMo 2 (output norms, QK-norm over the whole projections) with sliding-window and
full layers (``layer_types``; by default three sliding then one full), each layer type with
its RoPE settings (``rope_parameters.{full_attention, sliding_attention}``): a scaling reads
on the full layers, the sliding ones rotate unscaled on their own base."""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config, rope_by_layer_type, window_fields
from attnlab.pretrained.families.olmo2 import OLMO2, olmo2_config
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    checked_layer_types,
    require,
    rope_scaling_of,
    rope_theta_of,
)

_TYPES = ("sliding_attention", "full_attention")
_THETA = 500000.0  # transformers' default base


def _by_layer_type(c: dict) -> dict:
    """``rope_parameters`` per layer type, as transformers completes it."""
    params = dict(c.get("rope_parameters") or {})
    if not any(t in params for t in _TYPES):  # the older flat layout: the full layers' own
        flat = {"rope_type": "default", **params, **(c.get("rope_scaling") or {})}
        params = {"full_attention": flat, "sliding_attention": {"rope_type": "default"}}
    theta = c.get("rope_theta", _THETA)
    out = {t: {"rope_type": "default", **(params.get(t) or {})} for t in _TYPES}
    for spec in out.values():
        spec.setdefault("rope_theta", theta)
    return {**c, "rope_parameters": out, "rope_scaling": None}


def olmo3(c: dict) -> dict:
    c = _by_layer_type(c)
    n = require(c, "num_hidden_layers")
    types = c.get("layer_types") or [_TYPES[(i + 1) % 4 == 0] for i in range(n)]
    types = checked_layer_types(types, n, _TYPES)
    window = require(c, "sliding_window") if "sliding_attention" in types else None
    local = rope_theta_of(c, layer_type="sliding_attention")
    pattern = [
        {"window": window, "rope_theta": local} if t == "sliding_attention" else {"window": None}
        for t in types
    ]
    plain = {k: v for k, v in c.items() if k != "layer_types"}
    return olmo2_config(
        plain,
        rope_theta=rope_theta_of(c, layer_type="full_attention", scaled=True),
        rope_scaling=rope_scaling_of(c, "full_attention"),
        layer_pattern=pattern,
        sliding_window=None,
        sliding_window_layers=None,
    )


def olmo3_writer(cfg):
    out = {**base_config(cfg, "olmo3", "Olmo3ForCausalLM"), **window_fields(cfg)}
    out["rope_parameters"] = rope_by_layer_type(cfg, out["layer_types"], "OLMo 3")
    return out


register_family(
    Family("olmo3", config=olmo3, mapping=OLMO2, write=olmo3_writer, architectures=("Olmo3",))
)
