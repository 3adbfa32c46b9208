"""Qwen3.5 (text): ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``), Qwen3-Next's
hybrid of Gated DeltaNet and gated attention layers with a dense SwiGLU FFN in every layer,
and ``Qwen3_5MoeForCausalLM`` (``qwen3_5_moe_text``), with Qwen3-Next's experts and gated
shared expert (the router's top-k weights always renormalised): the same computation as
Qwen3-Next, so export writes it as ``qwen3_next``.
Its Gated DeltaNet stores the projections apart (``in_proj_qkv``: every query head, then every
key head, then every value head; ``in_proj_z``; ``in_proj_b``; ``in_proj_a``); the family's
``prepare`` regroups them per key head into Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``
(its ``finish`` splits them again on export), so Qwen3-Next's rows load them. A config.json
without ``partial_rotary_factor`` rotates a quarter of each head, as transformers does; with
text positions only, its multimodal RoPE sections rotate as plain RoPE."""

from __future__ import annotations

import numpy as np

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import base_config, single_mixers
from attnlab.pretrained.families.qwen3_next import (
    _QWEN3_NEXT_TYPES,
    QWEN3_NEXT,
    _block_pattern,
    qwen3_next,
)
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import reject, require, rope_decoder_fields
from attnlab.pretrained.mappings import L, Mapping, gated_ffn, table


def _with_rotary_default(c: dict) -> dict:
    params = dict(c.get("rope_parameters") or {})
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in c:
        params["partial_rotary_factor"] = 0.25  # transformers' default
    return {**c, "rope_parameters": params}


def qwen3_5_text(c: dict) -> dict:
    reject(c, "attention_bias", (True,), "Qwen3.5's gated attention has no biases")
    c = _with_rotary_default(c)
    return rope_decoder_fields(
        c, qk_norm=True, block_pattern=_block_pattern(c, require(c, "num_hidden_layers"))
    )


def _sizes(c: dict) -> tuple[int, int, int, int]:
    Nk, Nv = require(c, "linear_num_key_heads"), require(c, "linear_num_value_heads")
    return Nk, Nv // Nk, require(c, "linear_key_head_dim"), require(c, "linear_value_head_dim")


def fused_projections(tensors: dict, c: dict) -> dict:
    """Qwen3.5's separate Gated DeltaNet projections regrouped per key head as Qwen3-Next's:
    ``in_proj_qkvz`` rows ``[q_k, k_k, v_k, z_k]`` and ``in_proj_ba`` rows ``[b_k, a_k]`` for
    each key head ``k`` and the ``r`` value heads it serves."""
    Nk, r, Hk, Hv = _sizes(c)
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("linear_attn.in_proj_qkv.weight")]:
        at = name.removesuffix("in_proj_qkv.weight")
        qkv, z = out.pop(name), out.pop(at + "in_proj_z.weight")
        b, a = out.pop(at + "in_proj_b.weight"), out.pop(at + "in_proj_a.weight")
        q, k, v = np.split(qkv, [Nk * Hk, 2 * Nk * Hk])
        heads = lambda x, size: x.reshape(Nk, size, -1)
        out[at + "in_proj_qkvz.weight"] = np.concatenate(
            [heads(q, Hk), heads(k, Hk), heads(v, r * Hv), heads(z, r * Hv)], 1
        ).reshape(-1, qkv.shape[-1])
        out[at + "in_proj_ba.weight"] = np.concatenate([heads(b, r), heads(a, r)], 1).reshape(
            -1, qkv.shape[-1]
        )
    return out


def separate_projections(tensors: dict, c: dict) -> dict:
    """The inverse of ``fused_projections``, for export."""
    Nk, r, Hk, Hv = _sizes(c)
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("linear_attn.in_proj_qkvz.weight")]:
        at = name.removesuffix("in_proj_qkvz.weight")
        qkvz, ba = out.pop(name), out.pop(at + "in_proj_ba.weight")
        D = qkvz.shape[-1]
        q, k, v, z = np.split(qkvz.reshape(Nk, -1, D), np.cumsum([Hk, Hk, r * Hv]), 1)
        b, a = np.split(ba.reshape(Nk, 2 * r, D), [r], 1)
        flat = [x.reshape(-1, D) for x in (q, k, v, z, b, a)]
        out[at + "in_proj_qkv.weight"] = np.concatenate(flat[:3])
        out[at + "in_proj_z.weight"] = flat[3]
        out[at + "in_proj_b.weight"], out[at + "in_proj_a.weight"] = flat[4], flat[5]
    return out


QWEN3_5 = Mapping(
    prefix="model.",
    rules=table(
        *[rule for rule in QWEN3_NEXT.rules if ".mlp." not in rule.hf[0]],
        gated_ffn(f"{L}.mlp"),
    ),
    ignore=("lm_head.weight", "mtp.*", "model.visual.*"),
)


def qwen3_5_writer(cfg):
    mixers = single_mixers(cfg, "Qwen3.5", _QWEN3_NEXT_TYPES)
    if any(k.ffn_variant != "dense" for k in stack_plan(cfg, cfg.n_layers).kinds):
        raise ValueError("ffn_variant: Qwen3.5's layers each have a dense SwiGLU FFN")
    out = base_config(cfg, "qwen3_5_text", "Qwen3_5ForCausalLM")
    rotated = (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim
    out["rope_parameters"]["partial_rotary_factor"] = rotated
    out["layer_types"] = [_QWEN3_NEXT_TYPES[m.mixer] for m in mixers]
    linear = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "gated_deltanet"]
    if linear:
        g = linear[0]
        out.update(
            linear_num_value_heads=g.num_v_heads, linear_num_key_heads=g.num_k_heads,
            linear_key_head_dim=g.head_k_dim, linear_value_head_dim=g.head_v_dim,
            linear_conv_kernel_dim=g.conv_kernel,
        )  # fmt: skip
    return out


register_family(
    Family(
        "qwen3_5_text",
        config=qwen3_5_text,
        mapping=QWEN3_5,
        write=qwen3_5_writer,
        prepare=fused_projections,
        finish=separate_projections,
        architectures=("Qwen3_5",),
    )
)


def qwen3_5_moe_text(c: dict) -> dict:
    """Qwen3-Next's fields. Every Qwen3.5-MoE layer has experts, so its config.json has no
    dense FFN width (``intermediate_size``): the experts' width stands in for the one no
    layer reads."""
    c = {"intermediate_size": c.get("moe_intermediate_size"), **_with_rotary_default(c)}
    return qwen3_next(c)


# Qwen3.5-MoE computes as Qwen3-Next: export writes its models as that family.
register_family(
    Family(
        "qwen3_5_moe_text",
        config=qwen3_5_moe_text,
        mapping=QWEN3_NEXT,
        prepare=fused_projections,
        finish=separate_projections,
        architectures=("Qwen3_5Moe",),
    )
)
