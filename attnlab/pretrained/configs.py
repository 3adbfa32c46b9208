"""Hugging Face ``config.json`` -> attnlab ``ModelConfig``, one translator per family.

The family comes from ``model_type`` (or, when that is absent, from ``architectures``).
Every architectural switch a family has is read and either mapped to a ``ModelConfig``
field or, when attnlab has no equivalent, rejected with an ``UnsupportedCheckpointError``
that names the config.json key. Dropout rates are not carried over: loaded models run in
evaluation mode.

Both config layouts are read: transformers v5 keeps RoPE settings in ``rope_parameters``,
older files use top-level ``rope_theta`` / ``rope_scaling``.
"""

from __future__ import annotations

import json
import os

from attnlab.config import ModelConfig
from attnlab.errors import PretrainedError


class UnsupportedCheckpointError(PretrainedError, ValueError):
    """The checkpoint's family, or one of its config.json settings, has no attnlab equivalent."""


# Hugging Face activation names -> (plain FFN kind, gated FFN kind).
_ACTIVATIONS = {
    "relu": ("relu", None),
    "gelu": ("gelu", "geglu"),
    "gelu_new": ("gelu_tanh", "geglu_tanh"),
    "gelu_pytorch_tanh": ("gelu_tanh", "geglu_tanh"),
    "gelu_fast": ("gelu_tanh", "geglu_tanh"),
    "silu": ("silu", "swiglu"),
    "swish": ("silu", "swiglu"),
}


def _ffn(c: dict, key: str, default: str, *, gated: bool, name: str | None = None) -> str:
    """The FFN kind of activation ``c[key]`` (or ``name``, derived from that key)."""
    name = name or c.get(key) or default
    kinds = _ACTIVATIONS.get(name)
    kind = None if kinds is None else kinds[gated]
    if kind is None:
        supported = [k for k, v in _ACTIVATIONS.items() if v[gated] is not None]
        raise UnsupportedCheckpointError(
            f"config.json {key}={c.get(key, default)!r} (activation {name!r}) has no attnlab "
            f"{'gated ' if gated else ''}FFN equivalent; supported activations: {supported}"
        )
    return kind


def _require(c: dict, key: str):
    if c.get(key) is None:
        raise UnsupportedCheckpointError(f"config.json lacks the required field {key!r}")
    return c[key]


def _reject(c: dict, key: str, bad, why: str):
    """Raises when ``c[key]`` is one of the values attnlab cannot reproduce."""
    value = c.get(key)
    hit = value in bad if isinstance(bad, tuple) else bad(value)
    if hit:
        raise UnsupportedCheckpointError(f"config.json {key}={value!r} is not supported: {why}")


def _pad_id(c: dict, vocab_size: int) -> int:
    pad = c.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < vocab_size else 0


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    for key, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise UnsupportedCheckpointError(
                f"config.json {key}.rope_type={kind!r} is not supported: attnlab implements "
                "plain RoPE only (rope_type 'default')"
            )
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedCheckpointError(
            f"config.json partial_rotary_factor={c['partial_rotary_factor']} is not supported"
        )
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def _common(c: dict, **fields) -> dict:
    fields.setdefault("pad_id", _pad_id(c, fields["vocab_size"]))
    return fields


# Decoder-only families ----------------------------------------------------------------


def _gpt2(c: dict) -> dict:
    D = _require(c, "n_embd")
    _reject(c, "scale_attn_by_inverse_layer_idx", (True,), "per-layer attention scaling")
    _reject(c, "add_cross_attention", (True,), "decoder-only models have no cross-attention")
    return _common(
        c,
        arch="decoder",
        vocab_size=_require(c, "vocab_size"),
        d_model=D,
        n_layers=_require(c, "n_layer"),
        n_heads=_require(c, "n_head"),
        d_ff=c.get("n_inner") or 4 * D,
        max_len=_require(c, "n_positions"),
        position="learned",
        norm="layernorm",
        norm_eps=c.get("layer_norm_epsilon", 1e-5),
        norm_placement="pre",
        ffn=_ffn(c, "activation_function", "gelu_new", gated=False),
        attn_bias=True,
        out_bias=True,
        ffn_bias=True,
        tie_embeddings=c.get("tie_word_embeddings", True),
        attn_scale=None if c.get("scale_attn_weights", True) else 1.0,
    )


def _sliding_window(c: dict, family: str) -> dict:
    """``sliding_window`` and, when only some layers slide, ``sliding_window_layers``."""
    n = c.get("num_hidden_layers", 0)
    layer_types = c.get("layer_types")
    if layer_types is None:
        if family == "mistral":
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
    window = _require(c, "sliding_window")
    return {
        "sliding_window": window,
        "sliding_window_layers": None if len(sliding) == len(layer_types) else sliding,
    }


def _llama_like(c: dict, family: str) -> dict:
    _reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    D = _require(c, "hidden_size")
    N = _require(c, "num_attention_heads")
    bias = bool(c.get("attention_bias", False))
    attn_bias, out_bias = {
        "llama": (bias, bias),
        "mistral": (False, False),
        "qwen2": (True, False),
        "qwen3": (bias, bias),
    }[family]
    vocab = _require(c, "vocab_size")
    return _common(
        c,
        arch="decoder",
        vocab_size=vocab,
        d_model=D,
        n_layers=_require(c, "num_hidden_layers"),
        n_heads=N,
        n_kv_heads=c.get("num_key_value_heads") or N,
        head_dim=c.get("head_dim") or D // N,
        d_ff=_require(c, "intermediate_size"),
        max_len=c.get("max_position_embeddings") or 2048,
        position="rope",
        rope_theta=_rope_theta(c),
        norm="rmsnorm",
        norm_eps=c.get("rms_norm_eps", 1e-6),
        norm_placement="pre",
        qk_norm=family == "qwen3",
        ffn=_ffn(c, "hidden_act", "silu", gated=True),
        attn_bias=attn_bias,
        out_bias=out_bias,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        **_sliding_window(c, family),
    )


# Encoder-only ----------------------------------------------------------------------------


def _bert(c: dict) -> dict:
    _reject(
        c,
        "position_embedding_type",
        lambda v: v not in (None, "absolute"),
        "only absolute learned positions are implemented",
    )
    _reject(c, "is_decoder", (True,), "BERT is loaded as a bidirectional encoder")
    return _common(
        c,
        arch="encoder",
        vocab_size=_require(c, "vocab_size"),
        d_model=_require(c, "hidden_size"),
        n_layers=_require(c, "num_hidden_layers"),
        n_heads=_require(c, "num_attention_heads"),
        d_ff=_require(c, "intermediate_size"),
        max_len=_require(c, "max_position_embeddings"),
        position="learned",
        norm="layernorm",
        norm_eps=c.get("layer_norm_eps", 1e-12),
        norm_placement="post",
        final_norm=False,
        embedding_norm=True,
        ffn=_ffn(c, "hidden_act", "gelu", gated=False),
        attn_bias=True,
        out_bias=True,
        ffn_bias=True,
        tie_embeddings=c.get("tie_word_embeddings", True),
        logits_bias=True,
        type_vocab_size=c.get("type_vocab_size", 2),
        mlm_transform=True,
    )


# Encoder-decoder -------------------------------------------------------------------------


def _same(c: dict, enc_key: str, dec_key: str):
    enc, dec = _require(c, enc_key), c.get(dec_key, c.get(enc_key))
    if enc != dec:
        raise UnsupportedCheckpointError(
            f"config.json {enc_key}={enc} differs from {dec_key}={dec}; attnlab's "
            "encoder-decoder uses one value for both stacks"
        )
    return enc


def _bart_like(c: dict, family: str) -> dict:
    _reject(c, "normalize_before", (True,), "pre-norm BART variants (mBART) are not mapped")
    _reject(c, "add_final_layer_norm", (True,), "pre-norm BART variants (mBART) are not mapped")
    vocab = _require(c, "vocab_size")
    if family == "marian":
        _reject(
            c,
            "share_encoder_decoder_embeddings",
            (False,),
            "attnlab's encoder-decoder shares one embedding between its stacks",
        )
        _reject(
            c,
            "decoder_vocab_size",
            lambda v: v not in (None, vocab),
            "the decoder vocabulary must equal vocab_size",
        )
    fields = dict(
        arch="encoder_decoder",
        vocab_size=vocab,
        d_model=_require(c, "d_model"),
        n_layers=_require(c, "encoder_layers"),
        n_decoder_layers=c.get("decoder_layers") or c["encoder_layers"],
        n_heads=_same(c, "encoder_attention_heads", "decoder_attention_heads"),
        d_ff=_same(c, "encoder_ffn_dim", "decoder_ffn_dim"),
        max_len=_require(c, "max_position_embeddings"),
        norm="layernorm",
        norm_eps=1e-5,
        norm_placement="post",
        final_norm=False,
        ffn=_ffn(c, "activation_function", "gelu", gated=False),
        attn_bias=True,
        out_bias=True,
        ffn_bias=True,
        tie_embeddings=c.get("tie_word_embeddings", True),
        logits_bias=True,
    )
    if family == "marian":
        fields.update(
            position="sinusoidal",
            sinusoidal_layout="split",
            embed_scale=c.get("scale_embedding", True),
        )
    else:
        fields.update(
            position="learned",
            position_offset=2,
            embedding_norm=True,
            embed_scale=bool(c.get("scale_embedding", False)),
        )
    return _common(c, **fields)


def _t5_scales_output(c: dict) -> bool:
    """T5 multiplies the decoder output by d_model**-0.5 before a tied head.

    transformers v5 writes the switch as ``scale_decoder_outputs`` (and always ties);
    older files imply it by ``tie_word_embeddings`` (false for T5 v1.1).
    """
    if "scale_decoder_outputs" in c:
        return bool(c["scale_decoder_outputs"])
    return c.get("tie_word_embeddings", True) is not False


def _t5(c: dict) -> dict:
    proj = c.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise UnsupportedCheckpointError(f"config.json feed_forward_proj={proj!r} is unknown")
    gated = len(parts) == 2
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    D = _require(c, "d_model")
    tie = c.get("tie_word_embeddings", True) is not False
    return _common(
        c,
        arch="encoder_decoder",
        vocab_size=_require(c, "vocab_size"),
        d_model=D,
        n_layers=_require(c, "num_layers"),
        n_decoder_layers=c.get("num_decoder_layers") or c["num_layers"],
        n_heads=_require(c, "num_heads"),
        head_dim=_require(c, "d_kv"),
        d_ff=_require(c, "d_ff"),
        max_len=c.get("n_positions") or 512,
        position="relative",
        relative_buckets=c.get("relative_attention_num_buckets", 32),
        relative_max_distance=c.get("relative_attention_max_distance", 128),
        norm="rmsnorm",
        norm_eps=c.get("layer_norm_epsilon", 1e-6),
        norm_placement="pre",
        final_norm=True,
        ffn=_ffn(c, "feed_forward_proj", proj, gated=gated, name=act),
        tie_embeddings=tie,
        logits_scale=D**-0.5 if tie and _t5_scales_output(c) else 1.0,
        attn_scale=1.0,
    )


FAMILIES = {
    "gpt2": _gpt2,
    "llama": lambda c: _llama_like(c, "llama"),
    "mistral": lambda c: _llama_like(c, "mistral"),
    "qwen2": lambda c: _llama_like(c, "qwen2"),
    "qwen3": lambda c: _llama_like(c, "qwen3"),
    "bert": _bert,
    "bart": lambda c: _bart_like(c, "bart"),
    "marian": lambda c: _bart_like(c, "marian"),
    "t5": _t5,
}

# Class-name prefixes in ``architectures``, for config files without ``model_type``.
_ARCHITECTURE_PREFIXES = {
    "GPT2": "gpt2",
    "Llama": "llama",
    "Mistral": "mistral",
    "Qwen2": "qwen2",
    "Qwen3": "qwen3",
    "Bert": "bert",
    "Bart": "bart",
    "Marian": "marian",
    "T5": "t5",
}


def family_of(c: dict) -> str:
    """The family key of a config.json dict (``model_type``, else ``architectures``)."""
    model_type = c.get("model_type")
    if model_type is None:
        for arch in c.get("architectures") or ():
            for prefix, family in _ARCHITECTURE_PREFIXES.items():
                rest = arch[len(prefix) :]
                if arch.startswith(prefix) and (rest[:1].isupper() or not rest):
                    return family
        raise UnsupportedCheckpointError(
            f"config.json has no model_type and architectures={c.get('architectures')!r} names "
            f"no supported family; supported model_type values: {sorted(FAMILIES)}"
        )
    if model_type not in FAMILIES:
        raise UnsupportedCheckpointError(
            f"config.json model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return model_type


def model_config_from_hf(config, **overrides) -> ModelConfig:
    """The attnlab ``ModelConfig`` of a Hugging Face config.json: a dict, the file's path
    or its checkpoint folder.

    ``overrides`` replace fields afterwards (e.g. ``dtype="bfloat16"``).
    """
    if isinstance(config, str | os.PathLike):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}: pass a checkpoint folder")
        with open(path) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"expected a config.json dict or path, got {type(config).__name__}")
    fields = FAMILIES[family_of(config)](config)
    fields.update(overrides)
    return ModelConfig(**fields)
