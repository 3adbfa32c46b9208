"""config.json translators of the mixture-of-experts decoders: Mixtral, Qwen3-MoE,
gpt-oss and DeepSeek-V3.

Mixtral and Qwen3-MoE are Llama-shaped decoders (Mixtral as Mistral, Qwen3-MoE as Qwen3 with
QK-norm) whose FFNs are ``ffn_variant="moe"`` (Qwen3-MoE may keep dense ones in some
layers): softmax router scores, top-k experts, the top-k weights renormalised (Qwen3-MoE:
when ``norm_topk_prob``), each expert a SwiGLU FFN.
"""

from __future__ import annotations

from attnlab.ops.positions import yarn_mscale
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    prefix_and_block,
    reject,
    require,
)
from attnlab.pretrained.hf_llama import llama_like


def _moe(fields: dict, **settings) -> dict:
    return {**fields, "ffn_variant": "moe", "ffn_settings": settings}


def mixtral(c: dict) -> dict:
    return _moe(
        llama_like(c, "mistral"),
        n_experts=require(c, "num_local_experts"),
        top_k=require(c, "num_experts_per_tok"),
        renormalize=True,
        load_balance_weight=float(c.get("router_aux_loss_coef", 0.01)),
        z_loss_weight=0.0,
    )


def qwen3_moe(c: dict) -> dict:
    """Experts in the layers transformers makes sparse, a dense SwiGLU FFN of
    ``intermediate_size`` in the others (``mlp_only_layers``, and those not a multiple of
    ``decoder_sparse_step``): a ``block_pattern`` when any layer is dense, so a regular
    placement scans one block (``hf_base.prefix_and_block``)."""
    n = require(c, "num_hidden_layers")
    step = c.get("decoder_sparse_step", 1)
    step = 1 if step is None else step
    only = c.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise UnsupportedCheckpointError(
            f"config.json decoder_sparse_step={step!r} is not supported: give a positive int"
        )
    if not isinstance(only, list) or any(not isinstance(i, int) for i in only):
        raise UnsupportedCheckpointError(
            f"config.json mlp_only_layers={only!r} is not supported: give a list of layer indices"
        )
    fields = _moe(
        llama_like(c, "qwen3"),
        n_experts=c.get("num_local_experts") or require(c, "num_experts"),
        top_k=require(c, "num_experts_per_tok"),
        d_expert=require(c, "moe_intermediate_size"),
        renormalize=bool(c.get("norm_topk_prob", False)),
        load_balance_weight=float(c.get("router_aux_loss_coef", 0.001)),
        z_loss_weight=0.0,
    )
    dense = [i in only or (i + 1) % step != 0 for i in range(n)]
    if any(dense):
        kinds = [{"ffn_variant": "dense"} if d else {} for d in dense]
        fields["block_pattern"] = prefix_and_block(kinds)
    return fields


_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss(c: dict) -> dict:
    """Attention sinks (``mixer="sinks"``) with biases, sliding and full layers alternating,
    YaRN RoPE; experts chosen by a router with a bias (softmax over the top-k logits, i.e.
    renormalised top-k), each a clamped SwiGLU with biases."""
    n = require(c, "num_hidden_layers")
    if c.get("layer_types") is None:  # transformers' default: sliding first, then full
        types = ["sliding_attention", "full_attention"] * (n // 2) + ["sliding_attention"] * (n % 2)
        c = {**c, "layer_types": types}
    if not c.get("rope_parameters") and not c.get("rope_scaling"):  # transformers' default
        c = {**c, "rope_parameters": dict(_GPT_OSS_ROPE, rope_theta=c.get("rope_theta", 150000.0))}
    return _moe(
        {**llama_like(c, "gpt_oss"), "mixer": "sinks"},
        n_experts=require(c, "num_local_experts"),
        top_k=require(c, "num_experts_per_tok"),
        renormalize=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(c.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
        load_balance_weight=float(c.get("router_aux_loss_coef", 0.001)),
        z_loss_weight=0.0,
    )


def deepseek_v3(c: dict) -> dict:
    """Multi-head latent attention (``mixer="mla"``) and, after ``first_k_dense_replace``
    dense layers, experts chosen by sigmoid scores with a selection bias, grouped routing
    and shared experts."""
    reject(c, "topk_method", lambda v: v not in (None, "noaux_tc"), "only noaux_tc routing")
    reject(c, "scoring_func", lambda v: v not in (None, "sigmoid"), "only sigmoid scores")
    Hn, Hr = require(c, "qk_nope_head_dim"), require(c, "qk_rope_head_dim")
    fields = llama_like({**c, "head_dim": Hn + Hr}, "llama")
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
    return _moe(
        {**fields, "mixer": "mla", "mixer_settings": mla},
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
