"""T5: a pre-norm RMSNorm encoder-decoder with bucketed relative position biases (one table per
stack), plain or gated FFNs (``feed_forward_proj``)."""

from __future__ import annotations

from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import UnsupportedCheckpointError, common_fields, ffn_kind, require
from attnlab.pretrained.mappings import Mapping, linear_attention, norm_rows, table


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


def _t5_stack(stack):
    hf, ours = f"{stack}.block.{{i}}.layer", f"{stack}.layers.{{i}}"
    names = ("q", "k", "v", "o")
    rows = linear_attention(f"{hf}.0.SelfAttention", f"{ours}.attn", names=names, bias=False)
    rows += norm_rows(f"{hf}.0.layer_norm", f"{ours}.attn_norm", bias=False)
    ff = 1
    if stack == "decoder":
        rows += linear_attention(
            f"{hf}.1.EncDecAttention", f"{ours}.cross_attn", names=names, bias=False
        )
        rows += norm_rows(f"{hf}.1.layer_norm", f"{ours}.cross_norm", bias=False)
        ff = 2
    dense = f"{hf}.{ff}.DenseReluDense"
    rows += [
        (f"{dense}.wi_0.weight", f"{ours}.ffn.w_gate_DF", "linear"),  # gated variants only
        ((f"{dense}.wi_1.weight", f"{dense}.wi.weight"), f"{ours}.ffn.w_in_DF", "linear"),
        (f"{dense}.wo.weight", f"{ours}.ffn.w_out_FD", "linear"),
    ]
    rows += norm_rows(f"{hf}.{ff}.layer_norm", f"{ours}.ffn_norm", bias=False)
    rows += norm_rows(f"{stack}.final_layer_norm", f"{stack}.final_norm", bias=False)
    # One table per stack, stored on its first block and shared by all layers.
    rows += [
        (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            f"{stack}.relative.table_XN",
        )
    ]
    return rows


T5 = Mapping(
    rules=table(
        (
            ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"),
            "embed.tokens.embedding_VD",
        ),
        _t5_stack("encoder"),
        _t5_stack("decoder"),
        ("lm_head.weight", "head.head_DV", "linear"),
    ),
    ignore=(
        "encoder.embed_tokens.weight",
        "decoder.embed_tokens.weight",
        "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
        "lm_head.weight",
    ),
)


register_family(Family("t5", config=t5, mapping=T5, architectures=("T5",)))
