"""config.json translators of Gemma, Gemma 2 and Gemma 3 (text).

Gemma scales the token embeddings by ``sqrt(d_model)``, scales the attention logits by
``query_pre_attn_scalar ** -0.5`` and stores each RMSNorm's weight as ``w`` for a scale of
``1 + w`` (the tensor table adds the one). Gemma 2 and 3 put a norm before and after each
sublayer (``norm_placement="sandwich"``) and alternate local (sliding-window) and global
layers (``layer_pattern``), Gemma 3 with a RoPE base of its own for the local layers and
QK-norm; Gemma 2 soft-caps the attention logits (the ``mha`` mixer's ``softcap``) and the
output logits (``logits_softcap``).
"""

from __future__ import annotations

import functools

from attnlab.pretrained.export_configs import base_config, rope_by_layer_type, window_fields
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    decoder_fields,
    ffn_kind,
    reject,
    require,
    rope_scaling_of,
    rope_theta_of,
)
from attnlab.pretrained.mappings import (
    A,
    L,
    gated_ffn,
    layer_rows,
    llama_mapping,
    norm_row,
    self_attention,
)

_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(c: dict, family: str) -> list[str]:
    n = require(c, "num_hidden_layers")
    types = c.get("layer_types")
    if types is None:
        every = {"gemma2": 2, "gemma3_text": c.get("sliding_window_pattern", 6)}[family]
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
        ]
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown or len(types) != n:
        raise UnsupportedCheckpointError(
            f"config.json layer_types={types!r}: list num_hidden_layers={n} entries of "
            f"{list(_LAYER_TYPES)}"
        )
    return list(types)


def _layer_pattern(c: dict, family: str) -> tuple[float, list[dict] | None]:
    """``(rope_theta, layer_pattern)``: each layer's window and RoPE base. The model's
    RoPE scaling (``rope_parameters.full_attention``) scales the global layers; Gemma 3's
    local layers have a base of their own and rotate unscaled."""
    if family == "gemma":
        return rope_theta_of(c, scaled=True), None
    global_theta = rope_theta_of(c, layer_type="full_attention", scaled=True)
    local_theta = None  # Gemma 2: the global base and scaling
    if family == "gemma3_text":
        local_theta = float(
            c.get("rope_local_base_freq") or rope_theta_of(c, layer_type="sliding_attention")
        )
    types = _layer_types(c, family)
    window = require(c, "sliding_window") if "sliding_attention" in types else None
    pattern = [
        {"window": window, "rope_theta": local_theta}
        if kind == "sliding_attention"
        else {"window": None, "rope_theta": None}
        for kind in types
    ]
    return global_theta, pattern


def gemma(c: dict, family: str) -> dict:
    reject(c, "use_bidirectional_attention", (True,), "attnlab loads Gemma as a causal decoder")
    reject(c, "attention_bias", (True,), "Gemma checkpoints have no attention biases")
    N = require(c, "num_attention_heads")
    H = c.get("head_dim") or require(c, "hidden_size") // N
    theta, pattern = _layer_pattern(c, family)
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    softcap = c.get("attn_logit_softcapping") if family != "gemma" else None
    return decoder_fields(
        c,
        max_len=c.get("max_position_embeddings") or 8192,
        position="rope",
        rope_theta=theta,
        rope_scaling=rope_scaling_of(c, None if family == "gemma" else "full_attention"),
        layer_pattern=pattern,
        norm_placement="pre" if family == "gemma" else "sandwich",
        qk_norm=family == "gemma3_text",
        ffn=ffn_kind(c, "hidden_activation", "gelu_pytorch_tanh", gated=True, name=act),
        tie_embeddings=c.get("tie_word_embeddings", True) is not False,
        embed_scale=True,
        attn_scale=float(c.get("query_pre_attn_scalar") or H) ** -0.5,
        mixer_settings={"softcap": float(softcap)} if softcap else None,
        logits_softcap=(
            float(c["final_logit_softcapping"]) if c.get("final_logit_softcapping") else None
        ),
    )


# Every RMSNorm stores w for a scale of 1 + w; Gemma 2 and 3 add the sandwich's post-norms
# (the attention's own before the FFN's pre-norm), 3 QK-norm.
_SANDWICH = [
    *self_attention(bias=False, qk_norm=True, fn="plus_one"),
    norm_row(f"{L}.post_attention_layernorm", f"{A}.attn_post_norm", "plus_one"),
]
GEMMA = llama_mapping(
    layer_rows(_SANDWICH, ffn_norm="pre_feedforward_layernorm", fn="plus_one"),
    norm_row(f"{L}.post_feedforward_layernorm", f"{A}.ffn_post_norm", "plus_one"),
    gated_ffn(),
    fn="plus_one",
)
# Gemma 1 is pre-norm: its post_attention_layernorm is the FFN's input norm.
GEMMA1 = llama_mapping(
    layer_rows(self_attention(bias=False), fn="plus_one"), gated_ffn(), fn="plus_one"
)


def _gemma(cfg, model_type, architecture):
    out = base_config(cfg, model_type, architecture)
    out["hidden_activation"] = out.pop("hidden_act")
    scale = cfg.attn_scale**-2
    out["query_pre_attn_scalar"] = round(scale) if abs(scale - round(scale)) < 1e-6 else scale
    return out


def gemma_writer(cfg):
    return _gemma(cfg, "gemma", "GemmaForCausalLM")


def gemma2_writer(cfg):
    out = {**_gemma(cfg, "gemma2", "Gemma2ForCausalLM"), **window_fields(cfg)}
    out["attn_logit_softcapping"] = getattr(cfg.mixer_settings, "softcap", None)
    out["final_logit_softcapping"] = cfg.logits_softcap
    return out


def gemma3_text_writer(cfg):
    out = {**_gemma(cfg, "gemma3_text", "Gemma3ForCausalLM"), **window_fields(cfg)}
    out["rope_parameters"] = rope_by_layer_type(cfg, out["layer_types"], "Gemma 3")
    return out


for _family, _mapping, _write, _prefix in (
    ("gemma", GEMMA1, gemma_writer, "Gemma"),
    ("gemma2", GEMMA, gemma2_writer, "Gemma2"),
    ("gemma3_text", GEMMA, gemma3_text_writer, "Gemma3"),
):
    register_family(
        Family(
            _family,
            config=functools.partial(gemma, family=_family),
            mapping=_mapping,
            write=_write,
            architectures=(_prefix,),
        )
    )
