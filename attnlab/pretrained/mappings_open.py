"""Tensor-name tables of the open families of today: Gemma, Gemma 2/3, OLMo 2, Phi-3, Mixtral,
Qwen3-MoE, gpt-oss and DeepSeek-V3
(see ``attnlab.pretrained.mappings`` for what a table is). ``MAPPINGS`` holds every family's
table, these and the classic ones."""

from __future__ import annotations

import numpy as np

from attnlab.pretrained import mappings
from attnlab.pretrained.hf_hybrid import BAMBA, FALCON_H1, falcon_h1_multipliers
from attnlab.pretrained.hf_nemotron_h import NEMOTRON_H, nemotron_h_units
from attnlab.pretrained.hf_qwen3_next import QWEN3_NEXT
from attnlab.pretrained.hf_ssm import MAMBA2
from attnlab.pretrained.mappings import Mapping, _linear_attention, _table

_L = "model.layers.{i}"
_A = "decoder.layers.{i}"
_IGNORE = ("model.layers.*.self_attn.rotary_emb.inv_freq", "lm_head.weight")


def _norm(hf, ours, fn="copy"):
    return (f"{hf}.weight", f"{ours}.scale_D", fn)


def _gated_ffn():
    return [
        (f"{_L}.mlp.gate_proj.weight", f"{_A}.ffn.w_gate_DF", "linear"),
        (f"{_L}.mlp.up_proj.weight", f"{_A}.ffn.w_in_DF", "linear"),
        (f"{_L}.mlp.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
    ]


def _ends(fn="copy"):
    return [
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        _norm("model.norm", "decoder.final_norm", fn),
        ("lm_head.weight", "head.head_DV", "linear"),
    ]


# Gemma: every RMSNorm stores w for a scale of 1 + w; 2 and 3 add the sandwich's post-norms,
# 3 QK-norm.
GEMMA = Mapping(
    prefix="model.",
    rules=_table(
        _ends("plus_one"),
        _norm(f"{_L}.input_layernorm", f"{_A}.attn_norm", "plus_one"),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn", bias=False),
        _norm(f"{_L}.self_attn.q_norm", f"{_A}.attn.q_norm", "plus_one"),
        _norm(f"{_L}.self_attn.k_norm", f"{_A}.attn.k_norm", "plus_one"),
        _norm(f"{_L}.post_attention_layernorm", f"{_A}.attn_post_norm", "plus_one"),
        _norm(f"{_L}.pre_feedforward_layernorm", f"{_A}.ffn_norm", "plus_one"),
        _norm(f"{_L}.post_feedforward_layernorm", f"{_A}.ffn_post_norm", "plus_one"),
        _gated_ffn(),
    ),
    ignore=_IGNORE,
)
# Gemma 1 is pre-norm: its post_attention_layernorm is the FFN's input norm.
GEMMA1 = Mapping(
    prefix="model.",
    rules=_table(
        _ends("plus_one"),
        _norm(f"{_L}.input_layernorm", f"{_A}.attn_norm", "plus_one"),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn", bias=False),
        _norm(f"{_L}.post_attention_layernorm", f"{_A}.ffn_norm", "plus_one"),
        _gated_ffn(),
    ),
    ignore=_IGNORE,
)

# OLMo 2: each sublayer's output is normed (norm_placement="output"); QK-norm over the
# whole q and k projections.
OLMO2 = Mapping(
    prefix="model.",
    rules=_table(
        _ends(),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn"),
        _norm(f"{_L}.self_attn.q_norm", f"{_A}.attn.q_norm"),
        _norm(f"{_L}.self_attn.k_norm", f"{_A}.attn.k_norm"),
        _norm(f"{_L}.post_attention_layernorm", f"{_A}.attn_norm"),
        _norm(f"{_L}.post_feedforward_layernorm", f"{_A}.ffn_norm"),
        _gated_ffn(),
    ),
    ignore=_IGNORE,
)

# Phi-3: q | k | v in one qkv_proj, gate | up in one gate_up_proj.
PHI3 = Mapping(
    prefix="model.",
    rules=_table(
        _ends(),
        _norm(f"{_L}.input_layernorm", f"{_A}.attn_norm"),
        (
            f"{_L}.self_attn.qkv_proj.weight",
            (f"{_A}.attn.q_DNH", f"{_A}.attn.k_DKH", f"{_A}.attn.v_DKH"),
            "fused_linear_to_heads",
        ),
        (f"{_L}.self_attn.o_proj.weight", f"{_A}.attn.o_NHD", "linear_from_heads"),
        _norm(f"{_L}.post_attention_layernorm", f"{_A}.ffn_norm"),
        (
            f"{_L}.mlp.gate_up_proj.weight",
            (f"{_A}.ffn.w_gate_DF", f"{_A}.ffn.w_in_DF"),
            "fused_linear",
        ),
        (f"{_L}.mlp.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
    ),
    ignore=_IGNORE,
)


# Mixtral and Qwen3-MoE: a router and per-experts FFNs in place of the FFN (stacked on load);
# Qwen3-MoE's layers listed dense (mlp_only_layers, decoder_sparse_step) keep the plain FFN.
def _moe_table(moe, gate, up, down, *, qk_norm, dense=False):
    rows = [
        _ends(),
        _norm(f"{_L}.input_layernorm", f"{_A}.attn_norm"),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn", bias=False),
        _norm(f"{_L}.post_attention_layernorm", f"{_A}.ffn_norm"),
        (f"{_L}.{moe}.gate.weight", f"{_A}.ffn.router_DE", "linear"),
        (f"{_L}.{moe}.experts.{gate}.weight", f"{_A}.ffn.w_gate_EDF", "experts_linear"),
        (f"{_L}.{moe}.experts.{up}.weight", f"{_A}.ffn.w_in_EDF", "experts_linear"),
        (f"{_L}.{moe}.experts.{down}.weight", f"{_A}.ffn.w_out_EFD", "experts_linear"),
    ]
    if qk_norm:
        rows += [
            _norm(f"{_L}.self_attn.q_norm", f"{_A}.attn.q_norm"),
            _norm(f"{_L}.self_attn.k_norm", f"{_A}.attn.k_norm"),
        ]
    if dense:  # the plain FFN of the layers whose config keeps no experts
        rows.append(_gated_ffn())
    return Mapping(prefix="model.", rules=_table(*rows), ignore=_IGNORE)


MIXTRAL = _moe_table("block_sparse_moe", "w1", "w3", "w2", qk_norm=False)
QWEN3_MOE = _moe_table("mlp", "gate_proj", "up_proj", "down_proj", qk_norm=True, dense=True)


# gpt-oss: attention with biases and a sink logit per head; a router with a bias; experts
# stored stacked, gate and up interleaved in gate_up_proj [E, D, 2F], each with a bias.
_X = f"{_L}.mlp.experts"
GPT_OSS = Mapping(
    prefix="model.",
    rules=_table(
        _ends(),
        _norm(f"{_L}.input_layernorm", f"{_A}.attn_norm"),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn"),
        (f"{_L}.self_attn.sinks", f"{_A}.attn.sinks_N"),
        _norm(f"{_L}.post_attention_layernorm", f"{_A}.ffn_norm"),
        (f"{_L}.mlp.router.weight", f"{_A}.ffn.router_DE", "linear"),
        (f"{_L}.mlp.router.bias", f"{_A}.ffn.b_router_E"),
        (f"{_X}.gate_up_proj", (f"{_A}.ffn.w_gate_EDF", f"{_A}.ffn.w_in_EDF"), "interleaved"),
        (f"{_X}.gate_up_proj_bias", (f"{_A}.ffn.b_gate_EF", f"{_A}.ffn.b_in_EF"), "interleaved"),
        (f"{_X}.down_proj", f"{_A}.ffn.w_out_EFD"),
        (f"{_X}.down_proj_bias", f"{_A}.ffn.b_out_ED"),
    ),
    ignore=_IGNORE,
    per_expert=False,
)


# DeepSeek-V3: multi-head latent attention; dense FFNs in the first layers, then a router
# (with its selection bias), per-expert FFNs and shared experts.
_M = f"{_L}.self_attn"
DEEPSEEK_V3 = Mapping(
    prefix="model.",
    rules=_table(
        _ends(),
        _norm(f"{_L}.input_layernorm", f"{_A}.attn_norm"),
        (f"{_M}.q_proj.weight", f"{_A}.attn.q_DNH", "linear_to_heads"),
        (f"{_M}.q_a_proj.weight", f"{_A}.attn.q_down_DR", "linear"),
        _norm(f"{_M}.q_a_layernorm", f"{_A}.attn.q_norm"),
        (f"{_M}.q_b_proj.weight", f"{_A}.attn.q_up_RNH", "linear_to_heads"),
        (
            f"{_M}.kv_a_proj_with_mqa.weight",
            (f"{_A}.attn.kv_down_DR", f"{_A}.attn.k_rope_DH"),
            "fused_linear",
        ),
        _norm(f"{_M}.kv_a_layernorm", f"{_A}.attn.kv_norm"),
        (f"{_M}.kv_b_proj.weight", (f"{_A}.attn.k_up_RNH", f"{_A}.attn.v_up_RNH"), "kv_b_to_heads"),
        (f"{_M}.o_proj.weight", f"{_A}.attn.o_NHD", "linear_from_heads"),
        _norm(f"{_L}.post_attention_layernorm", f"{_A}.ffn_norm"),
        _gated_ffn(),
        (f"{_L}.mlp.gate.weight", f"{_A}.ffn.router_DE", "linear"),
        (f"{_L}.mlp.gate.e_score_correction_bias", f"{_A}.ffn.selection_bias_E"),
        (f"{_L}.mlp.experts.gate_proj.weight", f"{_A}.ffn.w_gate_EDF", "experts_linear"),
        (f"{_L}.mlp.experts.up_proj.weight", f"{_A}.ffn.w_in_EDF", "experts_linear"),
        (f"{_L}.mlp.experts.down_proj.weight", f"{_A}.ffn.w_out_EFD", "experts_linear"),
        (f"{_L}.mlp.shared_experts.gate_proj.weight", f"{_A}.ffn.shared_gate_DF", "linear"),
        (f"{_L}.mlp.shared_experts.up_proj.weight", f"{_A}.ffn.shared_in_DF", "linear"),
        (f"{_L}.mlp.shared_experts.down_proj.weight", f"{_A}.ffn.shared_out_FD", "linear"),
    ),
    ignore=_IGNORE,
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


# Per-family rewrites of the stored tensors before the table applies (stored name layouts
# that no per-tensor transform can see, such as a config-dependent row order).
PREPARE = {
    "deepseek_v3": deepseek_rope_layout,
    "falcon_h1": falcon_h1_multipliers,
    "nemotron_h": nemotron_h_units,
}

MAPPINGS = {
    **mappings.MAPPINGS,
    "gemma": GEMMA1,
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "olmo2": OLMO2,
    "phi3": PHI3,
    "mixtral": MIXTRAL,
    "qwen3_moe": QWEN3_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    "gpt_oss": GPT_OSS,
    "mamba2": MAMBA2,
    "qwen3_next": QWEN3_NEXT,
    "bamba": BAMBA,
    "falcon_h1": FALCON_H1,
    "nemotron_h": NEMOTRON_H,
}
