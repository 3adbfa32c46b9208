"""Llama-shaped decoders: Llama, Mistral, Qwen2 and Qwen3 (QK-norm per head). One table, one
translator whose switches (biases, QK-norm, which layers slide) the other families built on
it (OLMo 2, Phi-3, the mixtures of experts, SmolLM3...) set too."""

from __future__ import annotations

import functools

from attnlab.pretrained.export_configs import base_config
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    reject,
    require,
    rope_decoder_fields,
    rope_theta_of,
)
from attnlab.pretrained.mappings import (
    IGNORE,
    Mapping,
    gated_ffn,
    layer_rows,
    norm_row,
    self_attention,
    table,
)


def sliding_window(c: dict, *, always: bool = False) -> dict:
    """``sliding_window`` and, when only some layers slide, ``sliding_window_layers``, from
    ``layer_types``; without it every layer slides when ``always`` (Mistral, Phi-3), else
    those from ``max_window_layers`` on when ``use_sliding_window`` (Qwen2)."""
    n = c.get("num_hidden_layers", 0)
    layer_types = c.get("layer_types")
    if layer_types is None:
        if always:
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


def llama_like(
    c: dict,
    *,
    qkv_bias: bool | None = None,
    o_bias: bool | None = None,
    partial_rotary: bool = False,
    always_slides: bool = False,
    **fields,
) -> dict:
    """A Llama-shaped config.json's ``ModelConfig`` fields. The q/k/v and output biases follow
    ``attention_bias`` unless ``qkv_bias``/``o_bias`` fix them; ``partial_rotary``: the family
    rotates ``partial_rotary_factor`` of each head (the others refuse it); ``always_slides``:
    see ``sliding_window``; ``fields`` add to or override what it reads."""
    reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    bias = bool(c.get("attention_bias", False))
    read = dict(
        rope_theta=rope_theta_of(c, partial=partial_rotary, scaled=True),
        norm_placement="pre",
        qk_norm=False,
        qk_norm_scope="head",
        attn_bias=bias if qkv_bias is None else qkv_bias,
        out_bias=bias if o_bias is None else o_bias,
        **sliding_window(c, always=always_slides),
    )
    return rope_decoder_fields(c, **{**read, **fields})


LLAMA = Mapping(
    prefix="model.",
    rules=table(
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        layer_rows(self_attention(qk_norm=True)),
        gated_ffn(),
        norm_row("model.norm", "decoder.final_norm"),
        ("lm_head.weight", "head.head_DV", "linear"),
    ),
    ignore=IGNORE,
)


def _mistral_writer(cfg):
    windows = set(cfg.layer_windows(cfg.n_layers))
    if len(windows) > 1:
        raise ValueError(f"windows {sorted(windows, key=str)}: Mistral slides in every layer")
    return {**base_config(cfg, "mistral", "MistralForCausalLM"), "sliding_window": windows.pop()}


def _writer(model_type: str, prefix: str):
    """The writer of a family that is the plain Llama-shaped decoder."""
    return functools.partial(
        base_config, model_type=model_type, architecture=f"{prefix}ForCausalLM"
    )


# Llama and the special cases of it that read its table: (model_type, class-name prefix,
# translator, writer).
for _family, _prefix, _config, _write in (
    ("llama", "Llama", llama_like, _writer("llama", "Llama")),
    ("qwen3", "Qwen3", lambda c: llama_like(c, qk_norm=True), _writer("qwen3", "Qwen3")),
    (
        "mistral",
        "Mistral",
        lambda c: llama_like(c, qkv_bias=False, o_bias=False, always_slides=True),
        _mistral_writer,
    ),
    ("qwen2", "Qwen2", lambda c: llama_like(c, qkv_bias=True, o_bias=False), None),
):
    register_family(
        Family(_family, config=_config, mapping=LLAMA, write=_write, architectures=(_prefix,))
    )
