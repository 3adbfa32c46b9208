"""config.json translators of the Llama-shaped decoders: Llama, Mistral, Qwen2, Qwen3, OLMo 2
(a norm on each sublayer's output, QK-norm over the whole projections) and Phi-3 (fused
projections, partial rotary)."""

from __future__ import annotations

from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    reject,
    require,
    rope_decoder_fields,
    rope_theta_of,
)


def _sliding_window(c: dict, family: str) -> dict:
    """``sliding_window`` and, when only some layers slide, ``sliding_window_layers``."""
    n = c.get("num_hidden_layers", 0)
    layer_types = c.get("layer_types")
    if layer_types is None:
        if family in ("mistral", "phi3"):
            window, first_sliding = c.get("sliding_window"), 0
        else:
            window = c.get("sliding_window") if c.get("use_sliding_window") else None
            first_sliding = c.get("max_window_layers", 0)
        layer_types = [
            "sliding_attention" if window and i >= first_sliding else "full_attention"
            for i in range(n)
        ]
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedCheckpointError(
            f"config.json layer_types holds {sorted(unknown)}; attnlab knows "
            "'full_attention' and 'sliding_attention'"
        )
    sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    if not sliding:
        return {"sliding_window": None}
    window = require(c, "sliding_window")
    return {
        "sliding_window": window,
        "sliding_window_layers": None if len(sliding) == len(layer_types) else sliding,
    }


def llama_like(c: dict, family: str) -> dict:
    reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    bias = bool(c.get("attention_bias", False))
    attn_bias, out_bias = {
        "llama": (bias, bias),
        "mistral": (False, False),
        "qwen2": (True, False),
        "qwen3": (bias, bias),
        "olmo2": (bias, bias),
        "phi3": (False, False),
        "gpt_oss": (bias, bias),
    }[family]
    return rope_decoder_fields(
        c,
        # Only Phi-3 rotates a share of each head; the others refuse partial_rotary_factor.
        rope_theta=rope_theta_of(c, partial=family == "phi3", scaled=True),
        norm_placement="output" if family == "olmo2" else "pre",
        qk_norm=family in ("qwen3", "olmo2"),
        qk_norm_scope="projection" if family == "olmo2" else "head",
        attn_bias=attn_bias,
        out_bias=out_bias,
        **_sliding_window(c, family),
    )
