"""BERT (masked LM): a post-norm bidirectional encoder with learned absolute positions, token
type embeddings and the MLM transform before a tied head."""

from __future__ import annotations

from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import ALL_BIASES, common_fields, ffn_kind, reject, require
from attnlab.pretrained.mappings import Mapping, linear_attention, linear_ffn, norm_rows, table


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
        **ALL_BIASES,
        tie_embeddings=c.get("tie_word_embeddings", True),
        logits_bias=True,
        type_vocab_size=c.get("type_vocab_size", 2),
        mlm_transform=True,
    )


_B = "bert.encoder.layer.{i}"
_E = "encoder.layers.{i}"
BERT = Mapping(
    prefix="bert.",
    rules=table(
        ("bert.embeddings.word_embeddings.weight", "embed.tokens.embedding_VD"),
        ("bert.embeddings.position_embeddings.weight", "encoder.positions.table_PD"),
        ("bert.embeddings.token_type_embeddings.weight", "token_types_YD"),
        norm_rows("bert.embeddings.LayerNorm", "encoder.embed_norm"),
        linear_attention(
            f"{_B}.attention",
            f"{_E}.attn",
            names=("self.query", "self.key", "self.value", "output.dense"),
        ),
        norm_rows(f"{_B}.attention.output.LayerNorm", f"{_E}.attn_norm"),
        linear_ffn(f"{_B}.intermediate.dense", f"{_B}.output.dense", f"{_E}.ffn"),
        norm_rows(f"{_B}.output.LayerNorm", f"{_E}.ffn_norm"),
        ("cls.predictions.transform.dense.weight", "transform_DD", "linear"),
        ("cls.predictions.transform.dense.bias", "transform_bias_D"),
        norm_rows("cls.predictions.transform.LayerNorm", "transform_norm"),
        (("cls.predictions.bias", "cls.predictions.decoder.bias"), "head.bias_V"),
        ("cls.predictions.decoder.weight", "head.head_DV", "linear"),
    ),
    ignore=(
        "bert.embeddings.position_ids",
        "bert.pooler.*",  # sentence-level heads of other BERT classes
        "cls.seq_relationship.*",
        "cls.predictions.decoder.weight",
    ),
)


register_family(Family("bert", config=bert, mapping=BERT, architectures=("Bert",)))
