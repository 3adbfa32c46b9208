"""GLM-4.5 (``glm4_moe``): grouped-query attention with q/k/v biases (``attention_bias``), no
output bias, QK-norm per head when ``use_qk_norm``, RoPE on ``partial_rotary_factor`` of each
head (half-split); dense first layers (``first_k_dense_replace``), then DeepSeek-V3's experts
(sigmoid scores, a selection bias, grouped routing, routed scaling, shared experts). The
multi-token-prediction layers stored after the last layer are not loaded."""

from __future__ import annotations

import re

from attnlab.pretrained.export_configs import base_config
from attnlab.pretrained.families.deepseek_v3 import deepseek_moe_fields, deepseek_moe_settings
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import require
from attnlab.pretrained.mappings import deepseek_experts, layer_rows, llama_mapping, self_attention


def glm4_moe(c: dict) -> dict:
    fields = llama_like(
        c, o_bias=False, partial_rotary=True, qk_norm=bool(c.get("use_qk_norm", False))
    )
    return {**fields, "ffn_variant": "moe", "ffn_settings": deepseek_moe_settings(c)}


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def without_mtp_layers(tensors: dict, c: dict) -> dict:
    """The tensors of the layers the model runs (``num_nextn_predict_layers`` more follow)."""
    n = require(c, "num_hidden_layers")
    keep = lambda name: (m := _LAYER.match(name)) is None or int(m[1]) < n
    return {name: x for name, x in tensors.items() if keep(name)}


GLM4_MOE = llama_mapping(layer_rows(self_attention(qk_norm=True)), deepseek_experts())


def glm4_moe_writer(cfg):
    s = cfg.ffn_settings
    if getattr(cfg, "ffn_variant", None) != "moe" or s.score != "sigmoid":
        raise ValueError("ffn_settings: GLM-4.5's FFN is experts with sigmoid scores")
    if cfg.out_bias:
        raise ValueError("out_bias: GLM-4.5's output projection has no bias")
    out = base_config(cfg, "glm4_moe", "Glm4MoeForCausalLM")
    out["rope_parameters"]["partial_rotary_factor"] = (
        cfg.rotary_dim or cfg.head_dim
    ) / cfg.head_dim
    out.update(use_qk_norm=cfg.qk_norm, **deepseek_moe_fields(cfg), num_nextn_predict_layers=0)
    return out


register_family(
    Family(
        "glm4_moe",
        config=glm4_moe,
        mapping=GLM4_MOE,
        write=glm4_moe_writer,
        prepare=without_mtp_layers,
        architectures=("Glm4Moe",),
    )
)
