"""gpt-oss: attention sinks (``mixer="sinks"``) with q/k/v/o biases, sliding and full layers
alternating, YaRN; experts chosen by a router with a bias (softmax over the top-k logits),
stored stacked with gate and up interleaved in ``gate_up_proj``, each a clamped SwiGLU with
biases."""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config, experts, window_fields
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import require
from attnlab.pretrained.mappings import A, L, layer_rows, llama_mapping, self_attention

_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss(c: dict) -> dict:
    n = require(c, "num_hidden_layers")
    if c.get("layer_types") is None:  # transformers' default: sliding first, then full
        types = ["sliding_attention", "full_attention"] * (n // 2) + ["sliding_attention"] * (n % 2)
        c = {**c, "layer_types": types}
    if not c.get("rope_parameters") and not c.get("rope_scaling"):  # transformers' default
        c = {**c, "rope_parameters": dict(_GPT_OSS_ROPE, rope_theta=c.get("rope_theta", 150000.0))}
    return {
        **llama_like(c),
        "mixer": "sinks",
        "ffn_variant": "moe",
        "ffn_settings": dict(
            n_experts=require(c, "num_local_experts"),
            top_k=require(c, "num_experts_per_tok"),
            renormalize=True,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=float(c.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
            load_balance_weight=float(c.get("router_aux_loss_coef", 0.001)),
            z_loss_weight=0.0,
        ),
    }


# Attention with biases and a sink logit per head; a router with a bias; experts stored
# stacked, gate and up interleaved in gate_up_proj [E, D, 2F], each with a bias.
_X = f"{L}.mlp.experts"
GPT_OSS = llama_mapping(
    layer_rows([*self_attention(), (f"{L}.self_attn.sinks", f"{A}.attn.sinks_N")]),
    (f"{L}.mlp.router.weight", f"{A}.ffn.router_DE", "linear"),
    (f"{L}.mlp.router.bias", f"{A}.ffn.b_router_E"),
    (f"{_X}.gate_up_proj", (f"{A}.ffn.w_gate_EDF", f"{A}.ffn.w_in_EDF"), "interleaved"),
    (f"{_X}.gate_up_proj_bias", (f"{A}.ffn.b_gate_EF", f"{A}.ffn.b_in_EF"), "interleaved"),
    (f"{_X}.down_proj", f"{A}.ffn.w_out_EFD"),
    (f"{_X}.down_proj_bias", f"{A}.ffn.b_out_ED"),
    per_expert=False,
)


def gpt_oss_writer(cfg):
    if cfg.mixer != "sinks":
        raise ValueError(f"mixer={cfg.mixer!r}: gpt-oss attends with sinks")
    s = cfg.ffn_settings
    out = {
        **base_config(cfg, "gpt_oss", "GptOssForCausalLM"),
        **window_fields(cfg),
        **experts(cfg),
    }
    out["intermediate_size"] = s.d_expert or cfg.d_ff
    out["swiglu_limit"] = s.swiglu_limit
    out["swiglu_alpha"] = s.swiglu_alpha
    out["router_aux_loss_coef"] = s.load_balance_weight
    return out


register_family(
    Family(
        "gpt_oss", config=gpt_oss, mapping=GPT_OSS, write=gpt_oss_writer, architectures=("GptOss",)
    )
)
