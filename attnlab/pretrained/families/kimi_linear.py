"""Kimi Linear (``KimiLinearForCausalLM``): a hybrid of Kimi Delta Attention (the ``kda``
mixer) and multi-head latent attention without positions (``mla`` with ``position="none"``:
the decoupled key is shared but never rotated; its latents' norms at eps 1e-6 whatever
``rms_norm_eps``), three KDA layers to one MLA layer in the published model. The first
``first_k_dense_replace`` layers keep a dense SwiGLU; the others are experts with sigmoid
scores, a selection bias, grouped routing, routed scaling and a shared expert (DeepSeek-V3's
router).

config.json gives the layer kinds as ``layer_types`` (``linear_attention`` or
``full_attention``) or, as released, as ``linear_attn_config``'s 1-based ``kda_layers`` and
``full_attn_layers``; that dict's ``num_heads``, ``head_dim`` and ``short_conv_kernel_size``
win over ``linear_num_heads``, ``linear_head_dim`` and ``linear_conv_kernel_dim``, as in
transformers. The per-layer kinds become a ``block_pattern`` (``hf_base.prefix_and_block``).
Stored names are the released checkpoint's: the MoE under ``block_sparse_moe`` with experts
``w1``/``w3``/``w2`` (read as well under ``mlp``), q/k/v convolutions apart, ``A_log`` as
``[1, 1, N, 1]``.
"""

from __future__ import annotations

import re

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import single_mixers
from attnlab.pretrained.families.deepseek_v3 import latent_rows, mla_fields
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    checked_layer_types,
    decoder_fields,
    prefix_and_block,
    reject,
    require,
)
from attnlab.pretrained.mappings import A, L, deepseek_experts, layer_rows, llama_mapping

_KINDS = ("linear_attention", "full_attention")
LATENT_EPS = 1e-6  # transformers' latent norms keep their default eps, not rms_norm_eps


def _first(c: dict, *keys, default=None):
    """The first of ``keys`` that ``c`` holds (transformers' attribute names and their
    config.json spellings), else ``default``."""
    return next((c[k] for k in keys if c.get(k) is not None), default)


def _layer_types(c: dict, n: int) -> list[str]:
    """``layer_types``, else ``linear_attn_config``'s 1-based lists, else transformers'
    default (full attention at every fourth layer from the fifth), in transformers' order."""
    linear = c.get("linear_attn_config") or {}
    types = c.get("layer_types")
    if types is None and "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * n
        for layer in linear["full_attn_layers"]:
            types[layer - 1] = "full_attention"
        for layer in linear["kda_layers"]:
            types[layer - 1] = "linear_attention"
    elif types is None:
        types = [_KINDS[bool(i and i % 4 == 0)] for i in range(n)]
    return checked_layer_types(types, n, _KINDS)


def _mlp_types(c: dict, n: int) -> list[str]:
    types = c.get("mlp_layer_types")
    if types is None:
        dense = c.get("first_k_dense_replace", 1)
        types = ["dense" if i < dense else "sparse" for i in range(n)]
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise UnsupportedCheckpointError(
            f"config.json mlp_layer_types={types!r} is not supported: give num_hidden_layers={n} "
            "entries, each 'dense' or 'sparse'"
        )
    return list(types)


def kda_settings(c: dict) -> dict:
    linear = c.get("linear_attn_config") or {}
    H = _first(linear, "head_dim", default=c.get("linear_head_dim", 128))
    return {
        "num_heads": _first(linear, "num_heads", default=c.get("linear_num_heads", 32)),
        "head_dim": H,
        "gate_rank": H,
        "conv_kernel": _first(
            linear, "short_conv_kernel_size", default=c.get("linear_conv_kernel_dim", 4)
        ),
    }


def kimi_linear(c: dict) -> dict:
    """Kimi Delta Attention and NoPE latent attention layers; a dense SwiGLU first, then
    DeepSeek-style experts with a shared expert."""
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Kimi Linear gates with silu")
    reject(c, "attention_bias", (True,), "Kimi Linear's attention has no biases here")
    reject(
        c, "moe_router_activation_func", lambda v: v not in (None, "sigmoid"),
        "only sigmoid expert scores",
    )  # fmt: skip
    n = require(c, "num_hidden_layers")
    Hn, Hr = require(c, "qk_nope_head_dim"), require(c, "qk_rope_head_dim")
    mla = {
        "mixer": "mla",
        "mixer_settings": {
            "kv_lora_rank": require(c, "kv_lora_rank"),
            "q_lora_rank": c.get("q_lora_rank"),
            "qk_nope_head_dim": Hn,
            "qk_rope_head_dim": Hr,
            "v_head_dim": require(c, "v_head_dim"),
            "latent_norm_eps": LATENT_EPS,
        },
    }
    kda = {"mixer": "kda", "mixer_settings": kda_settings(c)}
    dense = {"ffn_variant": "dense"}
    kinds = [
        {**(mla if t == "full_attention" else kda), **(dense if f == "dense" else {})}
        for t, f in zip(_layer_types(c, n), _mlp_types(c, n), strict=True)
    ]
    N = require(c, "num_attention_heads")
    return decoder_fields(
        c,
        n_kv_heads=N,
        head_dim=Hn + Hr,
        max_len=_first(c, "model_max_length", "max_position_embeddings", default=1048576),
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        ffn_variant="moe",
        ffn_settings=dict(
            n_experts=_first(c, "num_experts", "num_local_experts", default=256),
            top_k=_first(c, "num_experts_per_token", "num_experts_per_tok", default=8),
            d_expert=require(c, "moe_intermediate_size"),
            score="sigmoid",
            renormalize=bool(_first(c, "moe_renormalize", "norm_topk_prob", default=True)),
            n_group=_first(c, "num_expert_group", "n_group", default=1),
            topk_group=c.get("topk_group") or 1,
            selection_bias=True,
            routed_scaling=float(c.get("routed_scaling_factor", 2.446)),
            n_shared=_first(c, "num_shared_experts", "n_shared_experts", default=1),
            load_balance_weight=0.0,
            z_loss_weight=0.0,
        ),
        block_pattern=prefix_and_block(kinds),
    )


_S, _X = f"{L}.self_attn", f"{A}.attn"
KIMI_LINEAR = llama_mapping(
    layer_rows(),
    # Both layer kinds: q_proj (KDA's queries, or MLA's without q compression), o_proj.
    (f"{_S}.q_proj.weight", f"{_X}.q_DNH", "linear_to_heads"),
    (f"{_S}.o_proj.weight", f"{_X}.o_NHD", "linear_from_heads"),
    # Kimi Delta Attention.
    (f"{_S}.k_proj.weight", f"{_X}.k_DNH", "linear_to_heads"),
    (f"{_S}.v_proj.weight", f"{_X}.v_DNH", "linear_to_heads"),
    (f"{_S}.q_conv1d.weight", f"{_X}.q_conv_WZ", "depthwise_conv"),
    (f"{_S}.k_conv1d.weight", f"{_X}.k_conv_WZ", "depthwise_conv"),
    (f"{_S}.v_conv1d.weight", f"{_X}.v_conv_WZ", "depthwise_conv"),
    (f"{_S}.f_a_proj.weight", f"{_X}.f_a_DR", "linear"),
    (f"{_S}.f_b_proj.weight", f"{_X}.f_b_RNH", "linear_to_heads"),
    (f"{_S}.A_log", f"{_X}.A_log_N"),  # [1, 1, N, 1] stored (prepare / finish)
    (f"{_S}.dt_bias", f"{_X}.dt_bias_NH", "flat"),
    (f"{_S}.b_proj.weight", f"{_X}.beta_DN", "linear"),
    (f"{_S}.g_a_proj.weight", f"{_X}.g_a_DR", "linear"),
    (f"{_S}.g_b_proj.weight", f"{_X}.g_b_RNH", "linear_to_heads"),
    (f"{_S}.o_norm.weight", f"{_X}.norm_scale_H"),
    # Latent attention.
    latent_rows(_S, _X),
    # The dense first layers, then the router, experts and shared expert.
    deepseek_experts(names=("w1", "w3", "w2")),
)

_MOE = re.compile(r"\.block_sparse_moe\.")
_MOE_PARTS = re.compile(r"\.mlp\.(?=gate\.|experts\.|shared_experts\.)")


def kimi_linear_prepare(tensors: dict, c: dict) -> dict:
    """The released names and layouts -> the table's: ``block_sparse_moe`` read as ``mlp``
    (transformers' own renaming), ``A_log`` ``[1, 1, N, 1]`` as ``[N]``."""
    out = {}
    for name, x in tensors.items():
        name = _MOE.sub(".mlp.", name)
        out[name] = x.reshape(-1) if name.endswith("self_attn.A_log") else x
    return out


def kimi_linear_finish(tensors: dict, c: dict) -> dict:
    """Export: ``kimi_linear_prepare``'s inverse, the released checkpoint's names."""
    out = {}
    for name, x in tensors.items():
        name = _MOE_PARTS.sub(".block_sparse_moe.", name)
        out[name] = x.reshape(1, 1, -1, 1) if name.endswith("self_attn.A_log") else x
    return out


_TYPES = {"kda": "linear_attention", "mla": "full_attention"}


def kimi_linear_writer(cfg):
    """KDA and NoPE latent-attention layers (``layer_types`` per layer, the settings of the
    first layer of each kind), a dense SwiGLU or DeepSeek-style experts in each layer."""
    mixers = single_mixers(cfg, "Kimi Linear", _TYPES)
    if cfg.position != "none":
        raise ValueError(f"position={cfg.position!r}: Kimi Linear's layers read no positions")
    kinds = stack_plan(cfg, cfg.n_layers).kinds
    s = cfg.ffn_settings
    if getattr(cfg, "ffn_variant", None) != "moe" or s.score != "sigmoid" or not s.selection_bias:
        raise ValueError("ffn_settings: Kimi Linear's experts use sigmoid scores and a bias")
    if any(k.ffn_variant not in ("moe", "dense") for k in kinds) or s.dense_layers:
        raise ValueError("ffn_variant: Kimi Linear's layers hold experts or a dense SwiGLU")
    out = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "model_max_length": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "pad_token_id": cfg.pad_id,
        "dtype": "float32",
        "layer_types": [_TYPES[m.mixer] for m in mixers],
        "mlp_layer_types": ["dense" if k.ffn_variant == "dense" else "sparse" for k in kinds],
        "num_experts": s.n_experts,
        "num_experts_per_token": s.top_k,
        "moe_intermediate_size": s.d_expert or cfg.d_ff,
        "moe_renormalize": s.renormalize,
        "num_expert_group": s.n_group,
        "topk_group": s.topk_group,
        "routed_scaling_factor": s.routed_scaling,
        "num_shared_experts": s.n_shared,
    }
    kda = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "kda"]
    if kda:
        k = kda[0]
        if k.gate_rank != k.head_dim:
            raise ValueError("mixer_settings.gate_rank: Kimi Linear's gates have rank head_dim")
        out.update(
            linear_num_heads=k.num_heads,
            linear_head_dim=k.head_dim,
            linear_conv_kernel_dim=k.conv_kernel,
        )
    mla = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "mla"]
    if mla:
        m = mla[0]
        if m.latent_norm_eps != LATENT_EPS:
            raise ValueError(f"mixer_settings.latent_norm_eps: Kimi Linear's is {LATENT_EPS}")
        out.update(mla_fields(m))
    return out


register_family(
    Family(
        "kimi_linear",
        config=kimi_linear,
        mapping=KIMI_LINEAR,
        write=kimi_linear_writer,
        prepare=kimi_linear_prepare,
        finish=kimi_linear_finish,
        architectures=("KimiLinear",),
    )
)
