"""Falcon-H1 (``FalconH1ForCausalLM``): every layer runs attention (``mha``) and Mamba-2 side
by side on the same normed input, their outputs summed (one layer kind of two mixers), then a
SwiGLU FFN. Its Mamba-2 has an inner width of its own (``mamba_d_ssm``: the mixer's
``d_inner``) and gates without a norm unless ``mamba_rms_norm``. Its muP multipliers scale
projections' inputs and outputs; ``falcon_h1_multipliers`` folds each into the stored weights
before the table applies (the family's ``prepare``), so the model computes with no multiplier
of its own but a tied head's ``logits_scale``.
"""

from __future__ import annotations

import numpy as np

from attnlab.pretrained.families.bamba import (
    FALCON_H1_DEFAULTS,
    bamba_mamba,
    decoder_mapping,
    with_defaults,
)
from attnlab.pretrained.families.mamba2 import mamba2_rows
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    reject,
    require,
    rope_decoder_fields,
    rope_theta_of,
)
from attnlab.pretrained.mappings import A, L, linear_attention


def falcon_h1(c: dict) -> dict:
    """``FalconH1Config`` -> a decoder whose every layer runs attention and Mamba-2 side by
    side on the same normed input (their outputs summed), then a SwiGLU FFN. The muP
    multipliers are folded into the weights on load (``falcon_h1_multipliers``); the output
    head's is ``logits_scale`` when the head is tied to the embeddings."""
    c = with_defaults(c, FALCON_H1_DEFAULTS)
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
    mamba = bamba_mamba(c)
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
    """``tensors[name]`` times ``factor``, in float64: the loader rounds once, to the model's
    dtype (a float32 product would leave a float64 model float32's rounding)."""
    if name in tensors and not (isinstance(factor, float) and factor == 1.0):
        tensors[name] = tensors[name].astype(np.float64) * factor


def _mup_rows(c: dict) -> np.ndarray:
    """Falcon-H1's ``mup_vector``: one multiplier per row of ``in_proj`` (z, x, B, C, dt)."""
    c = with_defaults(c, FALCON_H1_DEFAULTS)
    D = require(c, "hidden_size")
    inner = c.get("mamba_d_ssm") or c.get("mamba_expand", 2) * D
    gj = c.get("mamba_n_groups", 1) * c.get("mamba_d_state", 256)
    sizes = (inner, inner, gj, gj, require(c, "mamba_n_heads"))
    m = [float(v) for v in c.get("ssm_multipliers") or (1.0,) * 5]
    return np.concatenate([np.full(n, v, np.float64) for n, v in zip(sizes, m, strict=True)])


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


# The layer's two mixers side by side: attention first, then Mamba-2.
FALCON_H1 = decoder_mapping(
    linear_attention(f"{L}.self_attn", f"{A}.attn.0"), mamba2_rows(f"{L}.mamba", f"{A}.attn.1")
)


register_family(
    Family(
        "falcon_h1",
        config=falcon_h1,
        mapping=FALCON_H1,
        prepare=falcon_h1_multipliers,
        architectures=("FalconH1",),
    )
)
