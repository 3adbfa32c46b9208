"""Qwen3-MoE: Qwen3 (QK-norm) with ``ffn_variant="moe"`` (``moe_intermediate_size`` experts,
``norm_topk_prob`` as ``renormalize``); the layers its config keeps dense hold a SwiGLU FFN."""

from __future__ import annotations

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import base_config, experts
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import UnsupportedCheckpointError, prefix_and_block, require
from attnlab.pretrained.mappings import moe_table


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
    fields = {
        **llama_like(c, qk_norm=True),
        "ffn_variant": "moe",
        "ffn_settings": dict(
            n_experts=c.get("num_local_experts") or require(c, "num_experts"),
            top_k=require(c, "num_experts_per_tok"),
            d_expert=require(c, "moe_intermediate_size"),
            renormalize=bool(c.get("norm_topk_prob", False)),
            load_balance_weight=float(c.get("router_aux_loss_coef", 0.001)),
            z_loss_weight=0.0,
        ),
    }
    dense = [i in only or (i + 1) % step != 0 for i in range(n)]
    if any(dense):
        kinds = [{"ffn_variant": "dense"} if d else {} for d in dense]
        fields["block_pattern"] = prefix_and_block(kinds)
    return fields


def qwen3_moe_writer(cfg):
    """Experts in every layer but those whose FFN is dense (``mlp_only_layers``)."""
    experts(cfg)
    out = base_config(cfg, "qwen3_moe", "Qwen3MoeForCausalLM")
    d_expert = cfg.ffn_settings.d_expert or cfg.d_ff
    kinds = stack_plan(cfg, cfg.n_layers).kinds
    return {
        **out,
        **experts(cfg, moe_intermediate_size=d_expert, norm_topk_prob=cfg.ffn_settings.renormalize),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, k in enumerate(kinds) if k.ffn_variant == "dense"],
    }


register_family(
    Family(
        "qwen3_moe",
        config=qwen3_moe,
        mapping=moe_table("mlp", "gate_proj", "up_proj", "down_proj", qk_norm=True, dense=True),
        write=qwen3_moe_writer,
        architectures=("Qwen3Moe",),
    )
)
