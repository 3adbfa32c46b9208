"""Phi-3: q | k | v fused in ``qkv_proj``, gate | up in ``gate_up_proj`` (split on load),
partial rotary, LongRoPE; every layer slides when ``sliding_window`` is set."""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.mappings import IGNORE, A, L, Mapping, ends, norm_row, table

PHI3 = Mapping(
    prefix="model.",
    rules=table(
        ends(),
        norm_row(f"{L}.input_layernorm", f"{A}.attn_norm"),
        (
            f"{L}.self_attn.qkv_proj.weight",
            (f"{A}.attn.q_DNH", f"{A}.attn.k_DKH", f"{A}.attn.v_DKH"),
            "fused_linear_to_heads",
        ),
        (f"{L}.self_attn.o_proj.weight", f"{A}.attn.o_NHD", "linear_from_heads"),
        norm_row(f"{L}.post_attention_layernorm", f"{A}.ffn_norm"),
        (
            f"{L}.mlp.gate_up_proj.weight",
            (f"{A}.ffn.w_gate_DF", f"{A}.ffn.w_in_DF"),
            "fused_linear",
        ),
        (f"{L}.mlp.down_proj.weight", f"{A}.ffn.w_out_FD", "linear"),
    ),
    ignore=IGNORE,
)


def phi3_writer(cfg):
    out = base_config(cfg, "phi3", "Phi3ForCausalLM")
    del out["head_dim"], out["attention_bias"]
    if cfg.rotary_dim is not None:
        out["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    if cfg.rope_scaling is not None and cfg.rope_scaling.original_max_len is not None:
        # transformers' Phi-3 reads this top-level field over rope_parameters' own.
        out["original_max_position_embeddings"] = cfg.rope_scaling.original_max_len
    return out


register_family(
    Family(
        "phi3",
        config=lambda c: llama_like(
            c, qkv_bias=False, o_bias=False, partial_rotary=True, always_slides=True
        ),
        mapping=PHI3,
        write=phi3_writer,
        architectures=("Phi3",),
    )
)
