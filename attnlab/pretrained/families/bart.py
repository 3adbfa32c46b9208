"""BART and Marian: post-norm encoder-decoders sharing one embedding (Marian with split
sinusoidal positions and scaled embeddings, BART with learned positions offset by 2)."""

from __future__ import annotations

from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    ALL_BIASES,
    UnsupportedCheckpointError,
    common_fields,
    ffn_kind,
    reject,
    require,
)
from attnlab.pretrained.mappings import Mapping, linear_attention, linear_ffn, norm_rows, table


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
        **ALL_BIASES,
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


def _bart_stack(stack):
    hf, ours = f"model.{stack}.layers.{{i}}", f"{stack}.layers.{{i}}"
    rows = linear_attention(
        f"{hf}.self_attn", f"{ours}.attn", names=("q_proj", "k_proj", "v_proj", "out_proj")
    )
    rows += norm_rows(f"{hf}.self_attn_layer_norm", f"{ours}.attn_norm")
    if stack == "decoder":
        rows += linear_attention(
            f"{hf}.encoder_attn",
            f"{ours}.cross_attn",
            names=("q_proj", "k_proj", "v_proj", "out_proj"),
        )
        rows += norm_rows(f"{hf}.encoder_attn_layer_norm", f"{ours}.cross_norm")
    rows += linear_ffn(f"{hf}.fc1", f"{hf}.fc2", f"{ours}.ffn")
    rows += norm_rows(f"{hf}.final_layer_norm", f"{ours}.ffn_norm")
    rows += [(f"model.{stack}.embed_positions.weight", f"{stack}.positions.table_PD")]
    rows += norm_rows(f"model.{stack}.layernorm_embedding", f"{stack}.embed_norm")
    return rows


BART = Mapping(
    prefix="model.",
    rules=table(
        (
            (
                "model.shared.weight",
                "model.encoder.embed_tokens.weight",
                "model.decoder.embed_tokens.weight",
            ),
            "embed.tokens.embedding_VD",
        ),
        _bart_stack("encoder"),
        _bart_stack("decoder"),
        ("final_logits_bias", "head.bias_V", "row"),
        ("lm_head.weight", "head.head_DV", "linear"),
    ),
    ignore=(
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
        "model.*.embed_positions.weight",  # fixed sinusoidal tables (Marian), never learned
        "lm_head.weight",
    ),
)


register_family(
    Family("bart", config=lambda c: bart_like(c, "bart"), mapping=BART, architectures=("Bart",))
)
register_family(
    Family(
        "marian", config=lambda c: bart_like(c, "marian"), mapping=BART, architectures=("Marian",)
    )
)
