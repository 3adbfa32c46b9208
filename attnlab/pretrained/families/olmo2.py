"""OLMo 2: a Llama-shaped decoder whose sublayers' outputs are normed
(``norm_placement="output"``), with QK-norm over the whole q and k projections
(``qk_norm_scope="projection"``)."""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.mappings import (
    IGNORE,
    A,
    L,
    Mapping,
    ends,
    gated_ffn,
    linear_attention,
    norm_row,
    table,
)


def olmo2_config(c: dict, **fields) -> dict:
    read = dict(norm_placement="output", qk_norm=True, qk_norm_scope="projection")
    return llama_like(c, **{**read, **fields})


OLMO2 = Mapping(
    prefix="model.",
    rules=table(
        ends(),
        linear_attention(f"{L}.self_attn", f"{A}.attn"),
        norm_row(f"{L}.self_attn.q_norm", f"{A}.attn.q_norm"),
        norm_row(f"{L}.self_attn.k_norm", f"{A}.attn.k_norm"),
        norm_row(f"{L}.post_attention_layernorm", f"{A}.attn_norm"),
        norm_row(f"{L}.post_feedforward_layernorm", f"{A}.ffn_norm"),
        gated_ffn(),
    ),
    ignore=IGNORE,
)

register_family(
    Family(
        "olmo2",
        config=olmo2_config,
        mapping=OLMO2,
        write=lambda cfg: base_config(cfg, "olmo2", "Olmo2ForCausalLM"),
        architectures=("Olmo2",),
    )
)
