"""DeepSeek-V3: multi-head latent attention (``mixer="mla"``, q compression optional, RoPE
dims stored interleaved reordered on load), dense first layers (``first_k_dense_replace``),
then experts with sigmoid scores, a selection bias, grouped routing, routed scaling and shared
experts; YaRN with DeepSeek's ``mscale``/``mscale_all_dim``."""

from __future__ import annotations

import numpy as np

from attnlab.ops.positions import yarn_mscale
from attnlab.pretrained.export_configs import base_config, experts
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import reject, require
from attnlab.pretrained.mappings import (
    A,
    L,
    deepseek_experts,
    layer_rows,
    llama_mapping,
    norm_row,
)


def deepseek_v3(c: dict) -> dict:
    """Multi-head latent attention (``mixer="mla"``) and, after ``first_k_dense_replace``
    dense layers, experts chosen by sigmoid scores with a selection bias, grouped routing
    and shared experts."""
    reject(c, "topk_method", lambda v: v not in (None, "noaux_tc"), "only noaux_tc routing")
    reject(c, "scoring_func", lambda v: v not in (None, "sigmoid"), "only sigmoid scores")
    Hn, Hr = require(c, "qk_nope_head_dim"), require(c, "qk_rope_head_dim")
    fields = llama_like({**c, "head_dim": Hn + Hr})
    scaling = fields["rope_scaling"]
    if scaling and scaling["kind"] == "yarn" and scaling.get("mscale_all_dim"):
        # YaRN's temperature on the whole logit, beside the factor on the rotated dims.
        mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        fields["attn_scale"] = (Hn + Hr) ** -0.5 * mscale * mscale
    mla = {
        "kv_lora_rank": require(c, "kv_lora_rank"),
        "q_lora_rank": c.get("q_lora_rank"),
        "qk_nope_head_dim": Hn,
        "qk_rope_head_dim": Hr,
        "v_head_dim": require(c, "v_head_dim"),
    }
    return {
        **fields,
        "mixer": "mla",
        "mixer_settings": mla,
        "ffn_variant": "moe",
        "ffn_settings": deepseek_moe_settings(c),
    }


def deepseek_moe_settings(c: dict) -> dict:
    """DeepSeek's experts: sigmoid scores with a selection bias, grouped routing, routed
    scaling, shared experts after ``first_k_dense_replace`` dense layers."""
    return dict(
        n_experts=require(c, "n_routed_experts"),
        top_k=require(c, "num_experts_per_tok"),
        d_expert=require(c, "moe_intermediate_size"),
        score="sigmoid",
        renormalize=bool(c.get("norm_topk_prob", True)),
        n_group=c.get("n_group") or 1,
        topk_group=c.get("topk_group") or 1,
        selection_bias=True,
        routed_scaling=float(c.get("routed_scaling_factor", 1.0)),
        n_shared=c.get("n_shared_experts") or 0,
        dense_layers=c.get("first_k_dense_replace") or 0,
        load_balance_weight=0.0,
        z_loss_weight=0.0,
    )


def latent_rows(hf: str, ours: str) -> list:
    """Table rows of latent attention's compressions: transformers' ``hf`` -> attnlab's
    ``mla`` at ``ours`` (the queries' down and up projections with the norm between, the
    shared keys' and values' down projection beside the RoPE key, its norm, their up
    projections)."""
    return [
        (f"{hf}.q_a_proj.weight", f"{ours}.q_down_DR", "linear"),
        norm_row(f"{hf}.q_a_layernorm", f"{ours}.q_norm"),
        (f"{hf}.q_b_proj.weight", f"{ours}.q_up_RNH", "linear_to_heads"),
        (
            f"{hf}.kv_a_proj_with_mqa.weight",
            (f"{ours}.kv_down_DR", f"{ours}.k_rope_DH"),
            "fused_linear",
        ),
        norm_row(f"{hf}.kv_a_layernorm", f"{ours}.kv_norm"),
        (f"{hf}.kv_b_proj.weight", (f"{ours}.k_up_RNH", f"{ours}.v_up_RNH"), "kv_b_to_heads"),
    ]


# DeepSeek-V3: multi-head latent attention; dense FFNs in the first layers, then a router
# (with its selection bias), per-expert FFNs and shared experts.
_M = f"{L}.self_attn"
DEEPSEEK_V3 = llama_mapping(
    layer_rows(
        [
            (f"{_M}.q_proj.weight", f"{A}.attn.q_DNH", "linear_to_heads"),
            *latent_rows(_M, f"{A}.attn"),
            (f"{_M}.o_proj.weight", f"{A}.attn.o_NHD", "linear_from_heads"),
        ]
    ),
    deepseek_experts(),
)


def _deinterleave(w, size, rope):
    """Rows of ``w`` in blocks of ``size`` whose last ``rope`` rows are RoPE pairs stored
    interleaved (x0 y0 x1 y1 ...), reordered to the half-split layout (x0 x1 ... y0 y1 ...)."""
    perm = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)]) + size - rope
    order = np.arange(size)
    order[size - rope :] = perm
    blocks = w.reshape(-1, size, *w.shape[1:])
    return blocks[:, order].reshape(w.shape)


def deepseek_rope_layout(tensors: dict, c: dict) -> dict:
    """DeepSeek-V3 stores its RoPE dims interleaved (``rope_interleave``); attnlab rotates
    halves: the q and shared-key rows are reordered, which changes no logit."""
    if c.get("rope_interleave", True) is False:
        return tensors
    Hr, Hn = c["qk_rope_head_dim"], c["qk_nope_head_dim"]
    R = c["kv_lora_rank"]
    out = dict(tensors)
    for name, w in tensors.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            out[name] = _deinterleave(w, Hn + Hr, Hr)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            out[name] = _deinterleave(w, R + Hr, Hr)
    return out


def deepseek_moe_fields(cfg) -> dict:
    """config.json's fields of ``cfg``'s DeepSeek-style experts (``deepseek_moe_settings``
    read back)."""
    s = cfg.ffn_settings
    return dict(
        n_routed_experts=s.n_experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.d_expert or cfg.d_ff,
        n_group=s.n_group,
        topk_group=s.topk_group,
        n_shared_experts=s.n_shared,
        first_k_dense_replace=s.dense_layers,
        routed_scaling_factor=s.routed_scaling,
        norm_topk_prob=s.renormalize,
    )


def mla_fields(m) -> dict:
    """config.json's latent-attention sizes of resolved ``mla`` settings ``m``."""
    return dict(
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
    )


def deepseek_v3_writer(cfg):
    """MLA (its settings resolved) and experts after the dense first layers; RoPE dims are
    written in attnlab's half-split layout (``rope_interleave`` false)."""
    if cfg.mixer != "mla":
        raise ValueError(f"mixer={cfg.mixer!r}: DeepSeek-V3 attends with mla")
    m = cfg.mixer_settings.resolved(cfg)
    out = {**base_config(cfg, "deepseek_v3", "DeepseekV3ForCausalLM"), **experts(cfg)}
    del out["head_dim"], out["num_local_experts"]
    out.update(**mla_fields(m), rope_interleave=False, **deepseek_moe_fields(cfg))
    return out


register_family(
    Family(
        "deepseek_v3",
        config=deepseek_v3,
        mapping=DEEPSEEK_V3,
        write=deepseek_v3_writer,
        prepare=deepseek_rope_layout,
        architectures=("DeepseekV3",),
    )
)
