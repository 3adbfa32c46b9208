"""Mamba-2 hybrids that transformers writes: Bamba (``BambaForCausalLM``) and Falcon-H1
(``FalconH1ForCausalLM``), their config.json translators and tensor-name tables
(Nemotron-H: ``hf_nemotron_h``).

Bamba's layers are each ``x + mixer(norm(x))`` then ``x + SwiGLU(norm(x))``; the mixer is
Mamba-2 (attnlab's ``mamba2``, parameters in transformers' layout, its gated RMSNorm per
group of ``mamba_n_groups``) except at ``attn_layer_indices``, where it is Llama's attention
(``mha``) with RoPE on ``partial_rotary_factor`` of each head (0.5 when config.json does not
say, as transformers hard-codes it). The layer kinds become a ``block_pattern`` (a block
repeated after a prefix, ``hf_base.prefix_and_block``), so ``[M, A, M, A]`` scans one block
``[M, A]`` twice and an irregular placement loads with its start unrolled as the prefix.

Falcon-H1's every layer runs attention (``mha``) and Mamba-2 side by side on the same normed
input, their outputs summed (one layer kind of two mixers), then a SwiGLU FFN. Its Mamba-2
has an inner width of its own (``mamba_d_ssm``: the mixer's ``d_inner``) and gates without
a norm unless ``mamba_rms_norm``. Its muP multipliers scale projections' inputs and outputs;
``falcon_h1_multipliers`` folds each into the stored weights before the table applies (the
loader's ``PREPARE`` step), so the model computes with no multiplier of its own but a tied
head's ``logits_scale``.
"""

from __future__ import annotations

import numpy as np

from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    prefix_and_block,
    reject,
    require,
    rope_decoder_fields,
    rope_theta_of,
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


# transformers' defaults of the keys a config.json may leave out (where attnlab's differ).
_HYBRID_DEFAULTS = {"num_key_value_heads": 8}
_BAMBA_DEFAULTS = {
    **_HYBRID_DEFAULTS, "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_d_state": 256,
    "mamba_chunk_size": 256, "max_position_embeddings": 262144,
}  # fmt: skip
_FALCON_H1_DEFAULTS = {**_BAMBA_DEFAULTS, "mamba_d_ssm": 1024, "max_position_embeddings": 8192}


def _with_defaults(c: dict, defaults: dict, renamed: dict | None = None) -> dict:
    """``c`` with ``defaults`` where it leaves a key out, older keys read as ``renamed``."""
    renamed = {new: c[old] for old, new in (renamed or {}).items() if old in c}
    return {**defaults, **c, **renamed}


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
    c = _with_defaults(c, _BAMBA_DEFAULTS)
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Bamba's Mamba-2 gates with silu")
    reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    n = require(c, "num_hidden_layers")
    attention = _attention_layers(c, n)
    mamba = _bamba_mamba(c)
    kinds = [{"mixer": "mha"} if i in attention else mamba for i in range(n)]
    params = c.get("rope_parameters") or {}
    bias = bool(c.get("attention_bias", False))
    return rope_decoder_fields(
        c,
        rotary={"rope_parameters": {"partial_rotary_factor": 0.5, **params}},
        norm_eps=c.get("rms_norm_eps", 1e-5),
        attn_bias=bias,
        out_bias=bias,
        block_pattern=prefix_and_block(kinds),
    )


_L = "model.layers.{i}"
_A = "decoder.layers.{i}"


def _decoder_table(*mixer_rows):
    """The rows of a decoder whose layers keep Llama's names around their mixer's rows (the
    embedding, the norms, the SwiGLU FFN and the head), shared by Bamba and Falcon-H1."""
    return _table(
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        ("model.final_layernorm.weight", "decoder.final_norm.scale_D"),
        ("lm_head.weight", "head.head_DV", "linear"),
        (f"{_L}.input_layernorm.weight", f"{_A}.attn_norm.scale_D"),
        (f"{_L}.pre_ff_layernorm.weight", f"{_A}.ffn_norm.scale_D"),
        *mixer_rows,
        (f"{_L}.feed_forward.gate_proj.weight", f"{_A}.ffn.w_gate_DF", "linear"),
        (f"{_L}.feed_forward.up_proj.weight", f"{_A}.ffn.w_in_DF", "linear"),
        (f"{_L}.feed_forward.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
    )


BAMBA = Mapping(
    prefix="model.",
    rules=_decoder_table(
        mamba2_rows(f"{_L}.mamba", f"{_A}.attn"),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn"),
    ),
    ignore=("lm_head.weight",),
)


def falcon_h1(c: dict) -> dict:
    """``FalconH1Config`` -> a decoder whose every layer runs attention and Mamba-2 side by
    side on the same normed input (their outputs summed), then a SwiGLU FFN. The muP
    multipliers are folded into the weights on load (``falcon_h1_multipliers``); the output
    head's is ``logits_scale`` when the head is tied to the embeddings."""
    c = _with_defaults(c, _FALCON_H1_DEFAULTS)
    reject(
        c, "hidden_act", lambda v: v not in (None, "silu"), "Falcon-H1's Mamba-2 gates with silu"
    )
    reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    if bool(c.get("mamba_proj_bias", False)) != bool(c.get("projectors_bias", False)):
        raise UnsupportedCheckpointError(
            f"config.json mamba_proj_bias={c.get('mamba_proj_bias')!r} with projectors_bias="
            f"{c.get('projectors_bias')!r} is not supported: attnlab's Mamba-2 has biases on "
            "both its projections or neither; set them equal"
        )
    D = require(c, "hidden_size")
    mamba = _bamba_mamba(c)
    settings = mamba["mixer_settings"]
    settings["d_inner"] = c.get("mamba_d_ssm") or settings["expand"] * D
    if settings["head_dim"] * settings["num_heads"] != settings["d_inner"]:  # "auto" above
        settings["head_dim"] = settings["d_inner"] // settings["num_heads"]
    if not c.get("mamba_rms_norm", False):
        settings["norm"] = "none"
    elif c.get("mamba_norm_before_gate", True):
        settings["norm"] = "norm_then_gate"
    tied = bool(c.get("tie_word_embeddings", False))
    head = float(c.get("lm_head_multiplier", 1.0))
    bias = bool(c.get("attention_bias", False))
    return rope_decoder_fields(
        c,
        max_len=c.get("max_position_embeddings") or 8192,
        rope_theta=rope_theta_of(c, scaled=True),  # the whole head rotated
        norm_eps=c.get("rms_norm_eps", 1e-5),
        attn_bias=bias,
        out_bias=bias,
        logits_scale=head / float(c.get("embedding_multiplier", 1.0)) if tied else 1.0,
        block_pattern={"block": [{"mixers": ["mha", mamba]}]},
    )


def _scaled(tensors: dict, name: str, factor) -> None:
    if name in tensors and not (isinstance(factor, float) and factor == 1.0):
        tensors[name] = (tensors[name].astype(np.float32) * factor).astype(tensors[name].dtype)


def _mup_rows(c: dict) -> np.ndarray:
    """Falcon-H1's ``mup_vector``: one multiplier per row of ``in_proj`` (z, x, B, C, dt)."""
    c = _with_defaults(c, _FALCON_H1_DEFAULTS)
    D = require(c, "hidden_size")
    inner = c.get("mamba_d_ssm") or c.get("mamba_expand", 2) * D
    gj = c.get("mamba_n_groups", 1) * c.get("mamba_d_state", 256)
    sizes = (inner, inner, gj, gj, require(c, "mamba_n_heads"))
    m = [float(v) for v in c.get("ssm_multipliers") or (1.0,) * 5]
    return np.concatenate([np.full(n, v, np.float32) for n, v in zip(sizes, m, strict=True)])


def falcon_h1_multipliers(tensors: dict, c: dict) -> dict:
    """The muP multipliers of Falcon-H1's forward folded into the stored weights, each where
    transformers multiplies: a projection's output (rows and bias) or input (weight only)."""
    out = dict(tensors)
    f = lambda key: float(c.get(key, 1.0))
    _scaled(out, "model.embed_tokens.weight", f("embedding_multiplier"))
    if not c.get("tie_word_embeddings", False):
        _scaled(out, "lm_head.weight", f("lm_head_multiplier"))
    gate, down = (float(v) for v in c.get("mlp_multipliers") or (1.0, 1.0))
    mup = _mup_rows(c)
    n = require(c, "num_hidden_layers")
    for i in range(n):
        L = f"model.layers.{i}"
        _scaled(out, f"{L}.mamba.in_proj.weight", (mup * f("ssm_in_multiplier"))[:, None])
        _scaled(out, f"{L}.mamba.in_proj.bias", mup)
        for w in ("weight", "bias"):
            _scaled(out, f"{L}.mamba.out_proj.{w}", f("ssm_out_multiplier"))
            _scaled(out, f"{L}.self_attn.k_proj.{w}", f("key_multiplier"))
            _scaled(out, f"{L}.self_attn.o_proj.{w}", f("attention_out_multiplier"))
            _scaled(out, f"{L}.feed_forward.gate_proj.{w}", gate)
            _scaled(out, f"{L}.feed_forward.down_proj.{w}", down)
        for p in ("q_proj", "k_proj", "v_proj"):
            _scaled(out, f"{L}.self_attn.{p}.weight", f("attention_in_multiplier"))
    return out


_P = f"{_A}.attn"
FALCON_H1 = Mapping(
    prefix="model.",
    rules=_decoder_table(
        _linear_attention(f"{_L}.self_attn", f"{_P}.0"),
        mamba2_rows(f"{_L}.mamba", f"{_P}.1"),
    ),
    ignore=("lm_head.weight",),
)
