"""OLMo 2: a Llama-shaped decoder whose sublayers' outputs are normed
(``norm_placement="output"``), with QK-norm over the whole q and k projections
(``qk_norm_scope="projection"``)."""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.mappings import A, L, gated_ffn, llama_mapping, norm_row, self_attention


def olmo2_config(c: dict, **fields) -> dict:
    read = dict(norm_placement="output", qk_norm=True, qk_norm_scope="projection")
    return llama_like(c, **{**read, **fields})


# The norms after each sublayer take the pre-norm slots of attnlab's layer.
OLMO2 = llama_mapping(
    self_attention(qk_norm=True),
    norm_row(f"{L}.post_attention_layernorm", f"{A}.attn_norm"),
    norm_row(f"{L}.post_feedforward_layernorm", f"{A}.ffn_norm"),
    gated_ffn(),
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
