"""GPT-2: learned positions, LayerNorm, fused q | k | v in ``c_attn`` (``Conv1D`` layers store
``[in, out]``)."""

from __future__ import annotations

from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import ALL_BIASES, common_fields, ffn_kind, reject, require
from attnlab.pretrained.mappings import Mapping, fused, norm_rows, table


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
        **ALL_BIASES,
        tie_embeddings=c.get("tie_word_embeddings", True),
        attn_scale=None if c.get("scale_attn_weights", True) else 1.0,
    )


_G = "transformer.h.{i}"
_A = "decoder.layers.{i}"
_QKV, _QKV_BIASES = ("q_DNH", "k_DKH", "v_DKH"), ("q_bias_NH", "k_bias_KH", "v_bias_KH")
GPT2 = Mapping(
    prefix="transformer.",
    rules=table(
        ("transformer.wte.weight", "embed.tokens.embedding_VD"),
        ("transformer.wpe.weight", "decoder.positions.table_PD"),
        norm_rows(f"{_G}.ln_1", f"{_A}.attn_norm"),
        fused(f"{_G}.attn.c_attn", f"{_A}.attn", _QKV, _QKV_BIASES, "fused_columns_to_heads"),
        (f"{_G}.attn.c_proj.weight", f"{_A}.attn.o_NHD", "rows_from_heads"),
        (f"{_G}.attn.c_proj.bias", f"{_A}.attn.o_bias_D"),
        norm_rows(f"{_G}.ln_2", f"{_A}.ffn_norm"),
        (f"{_G}.mlp.c_fc.weight", f"{_A}.ffn.w_in_DF"),  # Conv1D is already [in, out]
        (f"{_G}.mlp.c_fc.bias", f"{_A}.ffn.b_in_F"),
        (f"{_G}.mlp.c_proj.weight", f"{_A}.ffn.w_out_FD"),
        (f"{_G}.mlp.c_proj.bias", f"{_A}.ffn.b_out_D"),
        norm_rows("transformer.ln_f", "decoder.final_norm"),
        ("lm_head.weight", "head.head_DV", "linear"),
    ),
    # Causal-mask buffers of older files; the tied head copy.
    ignore=("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias", "lm_head.weight"),
)


register_family(Family("gpt2", config=gpt2, mapping=GPT2, architectures=("GPT2",)))
