"""Mamba-2 hybrids that transformers writes: Bamba (``BambaForCausalLM``), the config.json
translator and the tensor-name table.

Bamba's layers are each ``x + mixer(norm(x))`` then ``x + SwiGLU(norm(x))``; the mixer is
Mamba-2 (attnlab's ``mamba2``, parameters in transformers' layout, its gated RMSNorm per
group of ``mamba_n_groups``) except at ``attn_layer_indices``, where it is Llama's attention
(``mha``) with RoPE on ``partial_rotary_factor`` of each head (0.5 when config.json does not
say, as transformers hard-codes it). The layer kinds become a ``block_pattern`` (a block
repeated after a prefix, ``hf_base.prefix_and_block``), so ``[M, A, M, A]`` scans one block
``[M, A]`` twice and an irregular placement loads with its start unrolled as the prefix.
"""

from __future__ import annotations

from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    common_fields,
    ffn_kind,
    prefix_and_block,
    reject,
    require,
    rope_scaling_of,
    rope_theta_of,
    rotary_fraction,
)
from attnlab.pretrained.hf_ssm import mamba2_rows, mamba2_settings
from attnlab.pretrained.mappings import Mapping, _linear_attention, _table

# BambaConfig's (and FalconH1Config's) key of each ``mamba2`` setting.
BAMBA_MAMBA_KEYS = {
    "expand": "mamba_expand",
    "head_dim": "mamba_d_head",
    "num_heads": "mamba_n_heads",
    "state_size": "mamba_d_state",
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "chunk_size": "mamba_chunk_size",
    "use_conv_bias": "mamba_conv_bias",
    "use_bias": "mamba_proj_bias",
}


def _bamba_mamba(c: dict) -> dict:
    D = require(c, "hidden_size")
    settings = mamba2_settings(c, BAMBA_MAMBA_KEYS)
    if settings["head_dim"] in (None, "auto"):  # transformers derives it
        settings["head_dim"] = settings["expand"] * D // settings["num_heads"]
    return {"mixer": "mamba2", "mixer_settings": settings}


def _attention_layers(c: dict, n: int) -> set:
    indices = c.get("attn_layer_indices") or []
    if any(not isinstance(i, int) or not 0 <= i < n for i in indices):
        raise UnsupportedCheckpointError(
            f"config.json attn_layer_indices={indices!r} is not supported: give layer indices "
            f"in [0, num_hidden_layers={n})"
        )
    return set(indices)


def bamba(c: dict) -> dict:
    """``BambaConfig`` -> a hybrid decoder of Mamba-2 and attention layers, each with a
    SwiGLU FFN."""
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Bamba's Mamba-2 gates with silu")
    reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    D, N = require(c, "hidden_size"), require(c, "num_attention_heads")
    H = c.get("head_dim") or D // N
    n = require(c, "num_hidden_layers")
    attention = _attention_layers(c, n)
    mamba = _bamba_mamba(c)
    kinds = [{"mixer": "mha"} if i in attention else mamba for i in range(n)]
    params = c.get("rope_parameters") or {}
    fraction = rotary_fraction({**c, "rope_parameters": {"partial_rotary_factor": 0.5, **params}})
    bias = bool(c.get("attention_bias", False))
    return common_fields(
        c,
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=D,
        n_layers=n,
        n_heads=N,
        n_kv_heads=c.get("num_key_value_heads") or N,
        head_dim=H,
        d_ff=require(c, "intermediate_size"),
        max_len=c.get("max_position_embeddings") or 2048,
        position="rope",
        rope_theta=rope_theta_of(c, partial=True, scaled=True),
        rope_scaling=rope_scaling_of(c),
        rotary_dim=None if fraction == 1.0 else int(H * fraction),
        norm="rmsnorm",
        norm_eps=c.get("rms_norm_eps", 1e-5),
        norm_placement="pre",
        ffn=ffn_kind(c, "hidden_act", "silu", gated=True),
        attn_bias=bias,
        out_bias=bias,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        block_pattern=prefix_and_block(kinds),
    )


_L = "model.layers.{i}"
_A = "decoder.layers.{i}"
BAMBA = Mapping(
    prefix="model.",
    rules=_table(
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        ("model.final_layernorm.weight", "decoder.final_norm.scale_D"),
        ("lm_head.weight", "head.head_DV", "linear"),
        (f"{_L}.input_layernorm.weight", f"{_A}.attn_norm.scale_D"),
        (f"{_L}.pre_ff_layernorm.weight", f"{_A}.ffn_norm.scale_D"),
        mamba2_rows(f"{_L}.mamba", f"{_A}.attn"),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn"),
        (f"{_L}.feed_forward.gate_proj.weight", f"{_A}.ffn.w_gate_DF", "linear"),
        (f"{_L}.feed_forward.up_proj.weight", f"{_A}.ffn.w_in_DF", "linear"),
        (f"{_L}.feed_forward.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
    ),
    ignore=("lm_head.weight",),
)
