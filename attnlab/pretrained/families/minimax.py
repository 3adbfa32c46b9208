"""MiniMax-01 (``MiniMaxForCausalLM``): lightning attention layers (``lightning``) and softmax
attention layers with RoPE (``mha``) by ``layer_types`` (7 to 1 in MiniMax-Text-01), a
mixture of experts in every layer (Mixtral's: softmax router, top-k renormalised, per-expert
``w1``/``w3``/``w2``).

Its layers keep the normed input as the residual, each sub-layer with a factor on either
side: ``h = norm(x)``, ``x' = alpha h + beta f(h)``. That is attnlab's post-norm
(``norm(x + f(x))``) with an embedding norm and no final norm, each norm moved one sub-layer
back: the first layer's ``input_layernorm`` becomes the embedding norm, each layer's
``post_attention_layernorm`` its attention sub-layer's norm, and the next layer's
``input_layernorm`` (the last layer: ``model.norm``) its FFN sub-layer's norm (the family's
``prepare`` renames them; ``finish`` renames them back). The factors fold into the weights,
exactly, as both sides are linear: ``alpha`` into the norm's scale with ``1 / alpha`` into
the sub-layer's input projections (q/k/v, lightning's ``qkv_proj`` and ``output_gate``, the
router and ``w1``/``w3``), ``beta`` into its output projection (``o_proj``/``out_proj``,
``w2``). Export writes the factors as 1. The decay buffers (``slope_rate``...) are computed
from the layer index, as transformers computes them, and not read.
"""

from __future__ import annotations

import numpy as np

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import base_config, experts, single_mixers
from attnlab.pretrained.families.llama import sliding_window
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    checked_layer_types,
    prefix_and_block,
    reject,
    require,
    rope_decoder_fields,
    rope_theta_of,
)
from attnlab.pretrained.mappings import (
    A,
    L,
    Mapping,
    linear_attention,
    norm_row,
    routed_experts,
    table,
)

_KINDS = ("linear_attention", "full_attention")
_FACTORS = {  # the sub-layer -> config.json keys of its (alpha, beta)
    "linear_attention": ("linear_attn_alpha_factor", "linear_attn_beta_factor"),
    "full_attention": ("full_attn_alpha_factor", "full_attn_beta_factor"),
    "mlp": ("mlp_alpha_factor", "mlp_beta_factor"),
}
_MOE = "block_sparse_moe"


def layer_types(c: dict) -> list[str]:
    """Each layer's type (transformers' default: full, linear, full, ...)."""
    n = require(c, "num_hidden_layers")
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)
    ]
    return checked_layer_types(types, n, _KINDS)


def _block_size(c: dict) -> int:
    """The blocks of the blockwise form: ``block_size`` down to a power of two (the blocks
    change the order of the sums, not the result)."""
    size = c.get("block_size", 256)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise UnsupportedCheckpointError(
            f"config.json block_size={size!r} is not supported: give a positive int"
        )
    return 1 << (size.bit_length() - 1)


def minimax(c: dict) -> dict:
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "MiniMax's layers use silu")
    reject(c, "attention_bias", (True,), "MiniMax's projections have no bias")
    lightning = {"mixer": "lightning", "mixer_settings": {"block_size": _block_size(c)}}
    kinds = [lightning if t == "linear_attention" else {"mixer": "mha"} for t in layer_types(c)]
    return rope_decoder_fields(
        c,
        rope_theta=rope_theta_of(c, scaled=True),
        rotary_dim=None,
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        norm_placement="post",
        embedding_norm=True,
        qk_norm=False,
        attn_bias=False,
        out_bias=False,
        **sliding_window({**c, "layer_types": None}, always=True),
        ffn_variant="moe",
        ffn_settings=dict(
            n_experts=c.get("num_local_experts") or require(c, "num_experts"),
            top_k=require(c, "num_experts_per_tok"),
            renormalize=True,
            load_balance_weight=float(c.get("router_aux_loss_coef", 0.001)),
            z_loss_weight=0.0,
        ),
        block_pattern=prefix_and_block(kinds),
    )


def _factors(c: dict, sublayer: str) -> tuple[float, float]:
    return tuple(float(c.get(key, 1.0)) for key in _FACTORS[sublayer])


def _scale(tensors: dict, name: str, factor: float) -> None:
    """``tensors[name]`` times ``factor``, kept in float64: the loader rounds once, to the
    model's dtype."""
    if factor != 1.0:
        tensors[name] = tensors[name].astype(np.float64) * factor


_ATTN_IN = {
    "linear_attention": ("self_attn.qkv_proj", "self_attn.output_gate"),
    "full_attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
}
_ATTN_OUT = {"linear_attention": "self_attn.out_proj", "full_attention": "self_attn.o_proj"}


def minimax_residuals(tensors: dict, c: dict) -> dict:
    """The residual factors folded into the weights and the norms moved one sub-layer back
    (the module docstring)."""
    out = dict(tensors)
    types = layer_types(c)
    mlp_alpha, mlp_beta = _factors(c, "mlp")
    for i, kind in enumerate(types):
        at = f"model.layers.{i}."
        alpha, beta = _factors(c, kind)
        _scale(out, at + "input_layernorm.weight", alpha)
        for name in _ATTN_IN[kind]:
            _scale(out, at + name + ".weight", 1 / alpha)
        _scale(out, at + _ATTN_OUT[kind] + ".weight", beta)
        _scale(out, at + "post_attention_layernorm.weight", mlp_alpha)
        for name in ("gate", "experts.w1", "experts.w3"):
            _scale(out, f"{at}{_MOE}.{name}.weight", 1 / mlp_alpha)
        _scale(out, f"{at}{_MOE}.experts.w2.weight", mlp_beta)
    n = len(types)
    out["model.embed_norm.weight"] = out.pop("model.layers.0.input_layernorm.weight")
    for i in range(1, n):
        out[f"model.layers.{i - 1}.next_norm.weight"] = out.pop(
            f"model.layers.{i}.input_layernorm.weight"
        )
    out[f"model.layers.{n - 1}.next_norm.weight"] = out.pop("model.norm.weight")
    return out


def minimax_norms(tensors: dict, c: dict) -> dict:
    """Export: the norms back under transformers' names (``minimax_residuals``' renames)."""
    out = dict(tensors)
    n = require(c, "num_hidden_layers")
    out["model.layers.0.input_layernorm.weight"] = out.pop("model.embed_norm.weight")
    for i in range(1, n):
        out[f"model.layers.{i}.input_layernorm.weight"] = out.pop(
            f"model.layers.{i - 1}.next_norm.weight"
        )
    out["model.norm.weight"] = out.pop(f"model.layers.{n - 1}.next_norm.weight")
    return out


_X, _LA = f"{A}.attn", f"{L}.self_attn"
MINIMAX = Mapping(
    prefix="model.",
    rules=table(
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        ("lm_head.weight", "head.head_DV", "linear"),
        norm_row("model.embed_norm", "decoder.embed_norm"),
        norm_row(f"{L}.post_attention_layernorm", f"{A}.attn_norm"),
        norm_row(f"{L}.next_norm", f"{A}.ffn_norm"),
        (f"{_LA}.qkv_proj.weight", f"{_X}.qkv_DNH", "linear_to_heads"),
        (f"{_LA}.output_gate.weight", f"{_X}.gate_DNH", "linear_to_heads"),
        (f"{_LA}.norm.weight", f"{_X}.norm_scale_NH", "flat"),
        (f"{_LA}.out_proj.weight", f"{_X}.out_NHD", "linear_from_heads"),
        linear_attention(_LA, _X, bias=False),
        routed_experts(f"{L}.{_MOE}", ("w1", "w3", "w2")),
    ),
    ignore=(
        "lm_head.weight",
        "model.layers.*.self_attn.slope_rate",
        "model.layers.*.self_attn.query_decay",
        "model.layers.*.self_attn.key_decay",
        "model.layers.*.self_attn.diagonal_decay",
    ),
)


def minimax_writer(cfg):
    if not (cfg.norm_placement == "post" and cfg.embedding_norm and cfg.norm == "rmsnorm"):
        raise ValueError("norm_placement: MiniMax is post-norm RMSNorm with an embedding norm")
    if cfg.position != "rope" or cfg.rotary_dim not in (None, cfg.head_dim):
        raise ValueError("position: MiniMax rotates whole heads with RoPE")
    if cfg.attn_bias or cfg.out_bias or cfg.qk_norm:
        raise ValueError("attn_bias: MiniMax's attention has no biases and no QK-norm")
    mixers = single_mixers(cfg, "MiniMax", {"lightning": None, "mha": None})
    lightning = [m.mixer_settings for m in mixers if m.mixer == "lightning"]
    if any(s.decay is not True or s.norm_eps != 1e-6 for s in lightning):
        raise ValueError("mixer_settings: MiniMax's lightning layers decay, their norm eps 1e-6")
    if len({s.block_size for s in lightning}) > 1:
        raise ValueError("mixer_settings.block_size: MiniMax's lightning layers share one")
    kinds = stack_plan(cfg, cfg.n_layers).kinds
    s = cfg.ffn_settings
    if any(k.ffn_variant != "moe" for k in kinds):
        raise ValueError("ffn_variant: MiniMax has experts in every layer")
    if not (s.renormalize and s.n_shared == 0 and s.d_expert in (None, cfg.d_ff)):
        raise ValueError("ffn_settings: MiniMax's experts are renormalised, d_ff wide, unshared")
    windows = set(cfg.layer_windows(cfg.n_layers))
    if len(windows) > 1:
        raise ValueError(f"windows {sorted(windows, key=str)}: MiniMax slides in every layer")
    out = {**base_config(cfg, "minimax", "MiniMaxForCausalLM"), **experts(cfg)}
    del out["attention_bias"]
    out.update(
        layer_types=["linear_attention" if m.mixer == "lightning" else "full_attention"
                     for m in mixers],
        block_size=lightning[0].block_size if lightning else 256,
        sliding_window=windows.pop(),
        router_aux_loss_coef=s.load_balance_weight,
        **{key: 1.0 for keys in _FACTORS.values() for key in keys},
    )  # fmt: skip
    return out


register_family(
    Family(
        "minimax",
        config=minimax,
        mapping=MINIMAX,
        write=minimax_writer,
        prepare=minimax_residuals,
        finish=minimax_norms,
        architectures=("MiniMax",),
    )
)
