"""config.json translators of the mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Both are Llama-shaped decoders (Mixtral as Mistral, Qwen3-MoE as Qwen3 with QK-norm) whose
every FFN is ``ffn_variant="moe"``: softmax router scores, top-k experts, the top-k weights
renormalised (Qwen3-MoE: when ``norm_topk_prob``), each expert a SwiGLU FFN.
"""

from __future__ import annotations

from attnlab.pretrained.hf_base import UnsupportedCheckpointError, require
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
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedCheckpointError(
            f"config.json mlp_only_layers={c.get('mlp_only_layers')!r} / decoder_sparse_step="
            f"{c.get('decoder_sparse_step')!r} is not supported: attnlab loads Qwen3-MoE with "
            "experts in every layer (mlp_only_layers [] and decoder_sparse_step 1)"
        )
    return _moe(
        llama_like(c, "qwen3"),
        n_experts=c.get("num_local_experts") or require(c, "num_experts"),
        top_k=require(c, "num_experts_per_tok"),
        d_expert=require(c, "moe_intermediate_size"),
        renormalize=bool(c.get("norm_topk_prob", False)),
        load_balance_weight=float(c.get("router_aux_loss_coef", 0.001)),
        z_loss_weight=0.0,
    )
