"""Llama-shaped decoders: Llama, Mistral, Qwen2 and Qwen3 (QK-norm per head). One table, one
translator whose switches (biases, QK-norm, which layers slide) the other families built on
it (OLMo 2, Phi-3, the mixtures of experts, SmolLM3...) set too."""

from __future__ import annotations

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


register_family(
    Family(
        "llama",
        config=llama_like,
        mapping=LLAMA,
        write=lambda cfg: base_config(cfg, "llama", "LlamaForCausalLM"),
        architectures=("Llama",),
    )
)
register_family(
    Family(
        "qwen3",
        config=lambda c: llama_like(c, qk_norm=True),
        mapping=LLAMA,
        write=lambda cfg: base_config(cfg, "qwen3", "Qwen3ForCausalLM"),
        architectures=("Qwen3",),
    )
)
register_family(
    Family(
        "mistral",
        config=lambda c: llama_like(c, qkv_bias=False, o_bias=False, always_slides=True),
        mapping=LLAMA,
        write=_mistral_writer,
        architectures=("Mistral",),
    )
)
register_family(
    Family(
        "qwen2",
        config=lambda c: llama_like(c, qkv_bias=True, o_bias=False),
        mapping=LLAMA,
        architectures=("Qwen2",),
    )
)
