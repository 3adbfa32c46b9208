"""Granite 4 (``GraniteMoeHybridForCausalLM``): a hybrid stack of Mamba-2 layers (``mamba2``,
Bamba's keys, the gated norm after the gate) and attention (RoPE when
``position_embedding_type`` is ``rope``, else none), each layer's FFN a mixture of experts
(the softmax of the top-k router logits; gate | up stacked in ``input_linear``) plus a shared
SwiGLU (``shared_mlp``), or the shared SwiGLU alone without experts. Its multipliers are
folded where they act: ``residual_multiplier`` into every sub-layer's output projection and
``embedding_multiplier`` into the embeddings (the family's ``prepare``), ``attention_multiplier``
as ``attn_scale``, ``logits_scaling`` as ``logits_scale`` (with a tied head, over the
embedding multiplier too)."""

from __future__ import annotations

import numpy as np

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import base_config, mamba2_keys, single_mixers
from attnlab.pretrained.families.bamba import BAMBA_MAMBA_KEYS, bamba_mamba
from attnlab.pretrained.families.mamba2 import mamba2_rows
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    checked_layer_types,
    prefix_and_block,
    require,
    rope_decoder_fields,
    rope_theta_of,
)
from attnlab.pretrained.mappings import (
    A,
    L,
    Mapping,
    ends,
    layer_rows,
    linear_attention,
    table,
)

_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
          "attention": "attention"}  # fmt: skip


def _layer_kinds(c: dict) -> list[str]:
    n = require(c, "num_hidden_layers")
    types = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * n
    return [_KINDS[t] for t in checked_layer_types(types, n, sorted(_KINDS))]


def granitemoehybrid(c: dict) -> dict:
    mamba = bamba_mamba(c)
    kinds = [mamba if k == "mamba" else {"mixer": "mha"} for k in _layer_kinds(c)]
    rope = c.get("position_embedding_type") == "rope"
    tied = bool(c.get("tie_word_embeddings", False))
    scale = 1.0 / float(c.get("logits_scaling", 1.0))
    if tied:
        scale /= float(c.get("embedding_multiplier", 1.0))
    bias = bool(c.get("attention_bias", False))
    experts = c.get("num_local_experts") or 0
    fields = rope_decoder_fields(
        c,
        d_ff=require(c, "shared_intermediate_size") if not experts else c["intermediate_size"],
        position="rope" if rope else "none",
        rope_theta=rope_theta_of(c, scaled=True),
        attn_bias=bias,
        out_bias=bias,
        attn_scale=float(c.get("attention_multiplier", 1.0)),
        logits_scale=scale,
        block_pattern=prefix_and_block(kinds),
    )
    if experts:
        fields["ffn_variant"] = "moe"
        fields["ffn_settings"] = {
            "n_experts": experts,
            "top_k": require(c, "num_experts_per_tok"),
            "d_expert": require(c, "intermediate_size"),
            "renormalize": True,
            "n_shared": 1,
            "d_shared": require(c, "shared_intermediate_size"),
            "load_balance_weight": float(c.get("router_aux_loss_coef", 0.001)),
            "z_loss_weight": 0.0,
        }
    return fields


def _scaled(tensors: dict, name: str, factor: float) -> None:
    """``tensors[name]`` times ``factor``, in float64: the loader rounds once, to the model's
    dtype (a float32 product would leave a float64 model float32's rounding)."""
    if name in tensors and factor != 1.0:
        tensors[name] = tensors[name].astype(np.float64) * factor


def granite_multipliers(tensors: dict, c: dict) -> dict:
    """The embedding multiplier folded into the embeddings, the residual multiplier into
    each sub-layer's output projection (attention, Mamba, experts, shared expert)."""
    out = dict(tensors)
    _scaled(out, "model.embed_tokens.weight", float(c.get("embedding_multiplier", 1.0)))
    r = float(c.get("residual_multiplier", 1.0))
    for i in range(require(c, "num_hidden_layers")):
        for part in ("self_attn.o_proj", "mamba.out_proj", "block_sparse_moe.output_linear",
                     "shared_mlp.output_linear"):  # fmt: skip
            for w in ("weight", "bias"):
                _scaled(out, f"model.layers.{i}.{part}.{w}", r)
    return out


_X = f"{A}.attn"
GRANITE_MOE_HYBRID = Mapping(
    prefix="model.",
    rules=table(
        ends(),
        layer_rows(),
        mamba2_rows(f"{L}.mamba", _X),
        linear_attention(f"{L}.self_attn", _X),
        (f"{L}.block_sparse_moe.router.layer.weight", f"{A}.ffn.router_DE", "linear"),
        (
            f"{L}.block_sparse_moe.input_linear.weight",
            (f"{A}.ffn.w_gate_EDF", f"{A}.ffn.w_in_EDF"),
            "experts_fused_linear",
        ),
        (f"{L}.block_sparse_moe.output_linear.weight", f"{A}.ffn.w_out_EFD", "experts_linear"),
        # The shared SwiGLU beside the experts, or the layer's only FFN without them.
        (
            f"{L}.shared_mlp.input_linear.weight",
            (f"{A}.ffn.shared_gate_DF", f"{A}.ffn.shared_in_DF"),
            "fused_linear",
        ),
        (f"{L}.shared_mlp.output_linear.weight", f"{A}.ffn.shared_out_FD", "linear"),
        (
            f"{L}.shared_mlp.input_linear.weight",
            (f"{A}.ffn.w_gate_DF", f"{A}.ffn.w_in_DF"),
            "fused_linear",
        ),
        (f"{L}.shared_mlp.output_linear.weight", f"{A}.ffn.w_out_FD", "linear"),
    ),  # fmt: skip
    ignore=("lm_head.weight",),
)


def granite_writer(cfg):
    mixers = single_mixers(cfg, "Granite 4", {"mamba2": None, "mha": None})
    kinds = stack_plan(cfg, cfg.n_layers).kinds
    out = base_config(cfg, "granitemoehybrid", "GraniteMoeHybridForCausalLM")
    del out["head_dim"]
    out["layer_types"] = ["linear_attention" if m.mixer == "mamba2" else "full_attention"
                          for m in mixers]  # fmt: skip
    out["position_embedding_type"] = "rope" if cfg.position == "rope" else "nope"
    out["attention_multiplier"] = (
        cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
    )
    out["embedding_multiplier"] = out["residual_multiplier"] = 1.0
    out["logits_scaling"] = 1.0 / cfg.logits_scale
    if all(k.ffn_variant == "dense" for k in kinds):
        out.update(num_local_experts=0, shared_intermediate_size=cfg.d_ff)
    elif any(k.ffn_variant != "moe" for k in kinds):
        raise ValueError("ffn_variant: Granite 4's layers all hold experts or all a SwiGLU")
    else:
        s = cfg.ffn_settings
        if not hasattr(s, "n_experts"):
            raise ValueError(f"ffn={cfg.ffn!r}: Granite 4's FFNs are SwiGLU or its experts")
        if not (s.n_shared == 1 and s.renormalize and not s.shared_gate):
            raise ValueError("ffn_settings: Granite 4's experts are renormalised, one shared")
        out.update(
            num_local_experts=s.n_experts, num_experts_per_tok=s.top_k,
            intermediate_size=s.d_expert or cfg.d_ff,
            shared_intermediate_size=s.d_shared or s.d_expert or cfg.d_ff,
        )  # fmt: skip
    mamba = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "mamba2"]
    if mamba:
        out.update(mamba2_keys(mamba[0], BAMBA_MAMBA_KEYS))
    return out


register_family(
    Family(
        "granitemoehybrid",
        config=granitemoehybrid,
        mapping=GRANITE_MOE_HYBRID,
        write=granite_writer,
        prepare=granite_multipliers,
        architectures=("GraniteMoeHybrid",),
    )
)
