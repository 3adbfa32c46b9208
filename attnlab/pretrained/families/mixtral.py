"""Mixtral: Mistral with ``ffn_variant="moe"`` in every layer (softmax router, top-k,
renormalised weights; per-expert ``w1``/``w3``/``w2`` stacked on load)."""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config, experts
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import require
from attnlab.pretrained.mappings import moe_table


def mixtral(c: dict) -> dict:
    fields = llama_like(c, qkv_bias=False, o_bias=False, always_slides=True)
    return {
        **fields,
        "ffn_variant": "moe",
        "ffn_settings": dict(
            n_experts=require(c, "num_local_experts"),
            top_k=require(c, "num_experts_per_tok"),
            renormalize=True,
            load_balance_weight=float(c.get("router_aux_loss_coef", 0.01)),
            z_loss_weight=0.0,
        ),
    }


def mixtral_writer(cfg):
    fields = experts(cfg)
    windows = set(cfg.layer_windows(cfg.n_layers))
    if len(windows) > 1:
        raise ValueError(f"windows {sorted(windows, key=str)}: Mixtral slides in every layer")
    out = {**base_config(cfg, "mixtral", "MixtralForCausalLM"), "sliding_window": windows.pop()}
    out["intermediate_size"] = cfg.ffn_settings.d_expert or cfg.d_ff
    return {**out, **fields}


register_family(
    Family(
        "mixtral",
        config=mixtral,
        mapping=moe_table("block_sparse_moe", "w1", "w3", "w2", qk_norm=False),
        write=mixtral_writer,
        architectures=("Mixtral",),
    )
)
