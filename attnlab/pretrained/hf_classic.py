"""config.json translators of GPT-2, BERT, BART, Marian and T5."""

from __future__ import annotations

from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    common_fields,
    ffn_kind,
    reject,
    require,
)

# GPT-2 ----------------------------------------------------------------


def gpt2(c: dict) -> dict:
    D = require(c, "n_embd")
    reject(c, "scale_attn_by_inverse_layer_idx", (True,), "per-layer attention scaling")
    reject(c, "add_cross_attention", (True,), "decoder-only models have no cross-attention")
    return common_fields(
        c,
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=D,
        n_layers=require(c, "n_layer"),
        n_heads=require(c, "n_head"),
        d_ff=c.get("n_inner") or 4 * D,
        max_len=require(c, "n_positions"),
        position="learned",
        norm="layernorm",
        norm_eps=c.get("layer_norm_epsilon", 1e-5),
        norm_placement="pre",
        ffn=ffn_kind(c, "activation_function", "gelu_new", gated=False),
        attn_bias=True,
        out_bias=True,
        ffn_bias=True,
        tie_embeddings=c.get("tie_word_embeddings", True),
        attn_scale=None if c.get("scale_attn_weights", True) else 1.0,
    )


# Encoder-only ----------------------------------------------------------------------------


def bert(c: dict) -> dict:
    reject(
        c,
        "position_embedding_type",
        lambda v: v not in (None, "absolute"),
        "only absolute learned positions are implemented",
    )
    reject(c, "is_decoder", (True,), "BERT is loaded as a bidirectional encoder")
    return common_fields(
        c,
        arch="encoder",
        vocab_size=require(c, "vocab_size"),
        d_model=require(c, "hidden_size"),
        n_layers=require(c, "num_hidden_layers"),
        n_heads=require(c, "num_attention_heads"),
        d_ff=require(c, "intermediate_size"),
        max_len=require(c, "max_position_embeddings"),
        position="learned",
        norm="layernorm",
        norm_eps=c.get("layer_norm_eps", 1e-12),
        norm_placement="post",
        final_norm=False,
        embedding_norm=True,
        ffn=ffn_kind(c, "hidden_act", "gelu", gated=False),
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
    enc, dec = require(c, enc_key), c.get(dec_key, c.get(enc_key))
    if enc != dec:
        raise UnsupportedCheckpointError(
            f"config.json {enc_key}={enc} differs from {dec_key}={dec}; attnlab's "
            "encoder-decoder uses one value for both stacks"
        )
    return enc


def bart_like(c: dict, family: str) -> dict:
    reject(c, "normalize_before", (True,), "pre-norm BART variants (mBART) are not mapped")
    reject(c, "add_final_layer_norm", (True,), "pre-norm BART variants (mBART) are not mapped")
    vocab = require(c, "vocab_size")
    if family == "marian":
        reject(
            c,
            "share_encoder_decoder_embeddings",
            (False,),
            "attnlab's encoder-decoder shares one embedding between its stacks",
        )
        reject(
            c,
            "decoder_vocab_size",
            lambda v: v not in (None, vocab),
            "the decoder vocabulary must equal vocab_size",
        )
    fields = dict(
        arch="encoder_decoder",
        vocab_size=vocab,
        d_model=require(c, "d_model"),
        n_layers=require(c, "encoder_layers"),
        n_decoder_layers=c.get("decoder_layers") or c["encoder_layers"],
        n_heads=_same(c, "encoder_attention_heads", "decoder_attention_heads"),
        d_ff=_same(c, "encoder_ffn_dim", "decoder_ffn_dim"),
        max_len=require(c, "max_position_embeddings"),
        norm="layernorm",
        norm_eps=1e-5,
        norm_placement="post",
        final_norm=False,
        ffn=ffn_kind(c, "activation_function", "gelu", gated=False),
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
    return common_fields(c, **fields)


def _t5_scales_output(c: dict) -> bool:
    """T5 multiplies the decoder output by d_model**-0.5 before a tied head.

    transformers v5 writes the switch as ``scale_decoder_outputs`` (and always ties);
    older files imply it by ``tie_word_embeddings`` (false for T5 v1.1).
    """
    if "scale_decoder_outputs" in c:
        return bool(c["scale_decoder_outputs"])
    return c.get("tie_word_embeddings", True) is not False


def t5(c: dict) -> dict:
    proj = c.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise UnsupportedCheckpointError(f"config.json feed_forward_proj={proj!r} is unknown")
    gated = len(parts) == 2
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    D = require(c, "d_model")
    tie = c.get("tie_word_embeddings", True) is not False
    return common_fields(
        c,
        arch="encoder_decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=D,
        n_layers=require(c, "num_layers"),
        n_decoder_layers=c.get("num_decoder_layers") or c["num_layers"],
        n_heads=require(c, "num_heads"),
        head_dim=require(c, "d_kv"),
        d_ff=require(c, "d_ff"),
        max_len=c.get("n_positions") or 512,
        position="relative",
        relative_buckets=c.get("relative_attention_num_buckets", 32),
        relative_max_distance=c.get("relative_attention_max_distance", 128),
        norm="rmsnorm",
        norm_eps=c.get("layer_norm_epsilon", 1e-6),
        norm_placement="pre",
        final_norm=True,
        ffn=ffn_kind(c, "feed_forward_proj", proj, gated=gated, name=act),
        tie_embeddings=tie,
        logits_scale=D**-0.5 if tie and _t5_scales_output(c) else 1.0,
        attn_scale=1.0,
    )
