"""Qwen3-Next checkpoints that transformers writes (``Qwen3NextForCausalLM``): the config.json
translator and the tensor-name table.

A hybrid decoder (``ModelConfig.block_pattern``): ``layer_types`` repeats a block of
``linear_attention`` layers (attnlab's ``gated_deltanet`` mixer, parameters in transformers'
layout) and ``full_attention`` layers (the ``gated`` mixer with ``kind="elementwise"``: the
rows of ``q_proj`` hold each head's query and then its output gate; QK-norm; RoPE on
``partial_rotary_factor`` of each head). Every layer's FFN is a mixture of experts with one
shared SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))``. The RMSNorms of the
layers, of q and k and the final one store ``w`` and scale by ``1 + w``; the gated RMSNorm
inside the linear-attention layer stores its scale. The multi-token-prediction head
(``mtp.*``) is not loaded.

Parameters of block position ``p`` live at ``decoder.layers.blocks.{p}.*`` stacked over the
block's repeats; the loader reads them as the checkpoint's layers ``p, p + P, ...``.
"""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config, single_mixers
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    checked_layer_types,
    reject,
    require,
    rope_decoder_fields,
)
from attnlab.pretrained.mappings import (
    A,
    L,
    Mapping,
    ends,
    layer_rows,
    qk_norms,
    routed_experts,
    shared_expert,
    table,
)

_KINDS = ("linear_attention", "full_attention")


def _period(types: list) -> int:
    """The shortest block whose repeats make ``types``."""
    n = len(types)
    return next(p for p in range(1, n + 1) if n % p == 0 and types == types[:p] * (n // p))


def _layer_kinds(c: dict, n: int) -> list[str]:
    types = c.get("layer_types")
    if types is None:  # transformers' default: every fourth layer full attention
        interval = c.get("full_attention_interval", 4)
        types = [_KINDS[(i + 1) % interval == 0] for i in range(n)]
    return checked_layer_types(types, n, _KINDS)


def _block_pattern(c: dict, n: int) -> dict:
    types = _layer_kinds(c, n)
    linear = {
        "mixer": "gated_deltanet",
        "mixer_settings": {
            "num_v_heads": require(c, "linear_num_value_heads"),
            "num_k_heads": require(c, "linear_num_key_heads"),
            "head_k_dim": require(c, "linear_key_head_dim"),
            "head_v_dim": require(c, "linear_value_head_dim"),
            "conv_kernel": c.get("linear_conv_kernel_dim", 4),
        },
    }
    full = {"mixer": "gated", "mixer_settings": {"kind": "elementwise"}}
    kind = {"linear_attention": linear, "full_attention": full}
    return {"block": [kind[t] for t in types[: _period(types)]]}


def qwen3_next(c: dict) -> dict:
    """``Qwen3NextConfig`` -> a hybrid decoder of Gated DeltaNet and gated attention layers,
    each with a mixture of experts and a gated shared expert."""
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedCheckpointError(
            f"config.json mlp_only_layers={c.get('mlp_only_layers')!r} / decoder_sparse_step="
            f"{c.get('decoder_sparse_step')!r} is not supported: attnlab loads Qwen3-Next with "
            "experts in every layer (mlp_only_layers [] and decoder_sparse_step 1)"
        )
    reject(c, "attention_bias", (True,), "Qwen3-Next's gated attention has no biases here")
    n = require(c, "num_hidden_layers")
    return rope_decoder_fields(
        c,
        qk_norm=True,
        block_pattern=_block_pattern(c, n),
        ffn_variant="moe",
        ffn_settings={
            "n_experts": require(c, "num_experts"),
            "top_k": require(c, "num_experts_per_tok"),
            "d_expert": require(c, "moe_intermediate_size"),
            "renormalize": bool(c.get("norm_topk_prob", True)),
            "n_shared": 1,
            "d_shared": require(c, "shared_expert_intermediate_size"),
            "shared_gate": True,
            "load_balance_weight": float(c.get("router_aux_loss_coef", 0.001)),
            "z_loss_weight": 0.0,
        },
    )


_LA, _GA = f"{L}.linear_attn", f"{A}.attn"
_SA, _X = f"{L}.self_attn", f"{L}.mlp"
QWEN3_NEXT = Mapping(
    prefix="model.",
    rules=table(
        ends("plus_one"),
        layer_rows(fn="plus_one"),
        # Gated DeltaNet (linear_attention layers).
        (f"{_LA}.in_proj_qkvz.weight", f"{_GA}.in_proj_qkvz_DKH", "linear_to_heads"),
        (f"{_LA}.in_proj_ba.weight", f"{_GA}.in_proj_ba_DKH", "linear_to_heads"),
        (f"{_LA}.conv1d.weight", f"{_GA}.conv_WZ", "depthwise_conv"),
        (f"{_LA}.A_log", f"{_GA}.A_log_N"),
        (f"{_LA}.dt_bias", f"{_GA}.dt_bias_N"),
        (f"{_LA}.norm.weight", f"{_GA}.norm_scale_J"),  # a plain scale, not 1 + w
        (f"{_LA}.out_proj.weight", f"{_GA}.out_proj_NJD", "linear_from_heads"),
        # Gated attention (full_attention layers).
        (f"{_SA}.q_proj.weight", (f"{_GA}.q_DNH", f"{_GA}.gate_DNH"), "query_and_gate"),
        (f"{_SA}.k_proj.weight", f"{_GA}.k_DKH", "linear_to_heads"),
        (f"{_SA}.v_proj.weight", f"{_GA}.v_DKH", "linear_to_heads"),
        (f"{_SA}.o_proj.weight", f"{_GA}.o_NHD", "linear_from_heads"),
        qk_norms(fn="plus_one"),
        # Experts (stored one per expert, stacked on load) and the gated shared expert.
        routed_experts(_X),
        shared_expert(f"{_X}.shared_expert"),
        (f"{_X}.shared_expert_gate.weight", f"{A}.ffn.shared_expert_gate_D", "row"),
    ),
    # The tied head's copy; the multi-token-prediction head, which attnlab does not run.
    ignore=("lm_head.weight", "mtp.*"),
)


# attnlab mixers -> Qwen3-Next's layer types (the gate must be elementwise: read back).
_QWEN3_NEXT_TYPES = {"gated_deltanet": "linear_attention", "gated": "full_attention"}


def qwen3_next_writer(cfg):
    """Gated DeltaNet and gated attention layers (``layer_types`` per layer, the DeltaNet
    settings of the first such layer), every FFN experts with one gated shared expert."""
    mixers = single_mixers(cfg, "Qwen3-Next", _QWEN3_NEXT_TYPES)
    s = cfg.ffn_settings
    if getattr(cfg, "ffn_variant", None) != "moe" or s.n_shared != 1 or not s.shared_gate:
        raise ValueError("ffn_settings: Qwen3-Next's FFN is experts with one gated shared expert")
    out = base_config(cfg, "qwen3_next", "Qwen3NextForCausalLM")
    if cfg.rotary_dim is not None:
        out["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    out["layer_types"] = [_QWEN3_NEXT_TYPES[m.mixer] for m in mixers]
    linear = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "gated_deltanet"]
    if linear:
        g = linear[0]
        out.update(
            linear_num_value_heads=g.num_v_heads,
            linear_num_key_heads=g.num_k_heads,
            linear_key_head_dim=g.head_k_dim,
            linear_value_head_dim=g.head_v_dim,
            linear_conv_kernel_dim=g.conv_kernel,
        )
    d_expert = s.d_expert or cfg.d_ff
    out.update(
        num_experts=s.n_experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=d_expert,
        shared_expert_intermediate_size=s.d_shared or d_expert,
        norm_topk_prob=s.renormalize,
        router_aux_loss_coef=s.load_balance_weight,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return out


register_family(
    Family(
        "qwen3_next",
        config=qwen3_next,
        mapping=QWEN3_NEXT,
        write=qwen3_next_writer,
        architectures=("Qwen3Next",),
    )
)
