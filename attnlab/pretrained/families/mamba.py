"""Mamba-1 checkpoints (``MambaForCausalLM``): every layer is ``norm -> MambaMixer ->
residual`` with no MLP, built as a pre-norm decoder of ``mamba`` mixers (parameters in
transformers' layout) with ``ffn_variant="none"`` and no positions, as Mamba-2's."""

from __future__ import annotations

import math

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import single_mixers
from attnlab.pretrained.families.mamba2 import MAMBA2_MAX_LEN
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import common_fields, reject, require
from attnlab.pretrained.mappings import Mapping, table


def mamba_settings(c: dict, prefix: str = "") -> dict:
    """The ``mamba`` mixer settings of config.json ``c`` (its keys after ``prefix``)."""
    get = lambda key, default=None: c.get(prefix + key, default)
    rank = get("time_step_rank", "auto") if prefix == "" else get("dt_rank", "auto")
    if rank in (None, "auto"):
        rank = math.ceil(require(c, "hidden_size") / 16)
    return {
        "expand": get("expand", 2),
        "state_size": get("state_size" if prefix == "" else "d_state", 16),
        "dt_rank": rank,
        "conv_kernel": get("conv_kernel" if prefix == "" else "d_conv", 4),
        "use_conv_bias": bool(get("use_conv_bias" if prefix == "" else "conv_bias", True)),
        "use_bias": bool(get("use_bias" if prefix == "" else "proj_bias", False)),
        "time_step_min": float(c.get("time_step_min", 0.001)),
        "time_step_max": float(c.get("time_step_max", 0.1)),
        "time_step_floor": float(c.get("time_step_floor", 1e-4)),
    }


def mamba(c: dict) -> dict:
    """``MambaConfig`` -> a decoder of ``mamba`` layers without FFN."""
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Mamba gates with silu only")
    return common_fields(
        c,
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=require(c, "hidden_size"),
        n_layers=require(c, "num_hidden_layers"),
        n_heads=1,
        max_len=MAMBA2_MAX_LEN,
        position="none",
        norm="rmsnorm",
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        norm_placement="pre",
        final_norm=True,
        mixer="mamba",
        mixer_settings=mamba_settings(c),
        ffn_variant="none",
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
    )


def mamba_rows(hf: str, ours: str) -> list:
    """Table rows of one Mamba-1 mixer: transformers' ``hf`` -> attnlab's ``ours``."""
    return [
        (f"{hf}.in_proj.weight", f"{ours}.in_proj_DZ", "linear"),
        (f"{hf}.in_proj.bias", f"{ours}.in_proj_bias_Z"),
        (f"{hf}.conv1d.weight", f"{ours}.conv_WZ", "depthwise_conv"),
        (f"{hf}.conv1d.bias", f"{ours}.conv_bias_Z"),
        (f"{hf}.x_proj.weight", f"{ours}.x_proj_ZR", "linear"),
        (f"{hf}.dt_proj.weight", f"{ours}.dt_proj_RZ", "linear"),
        (f"{hf}.dt_proj.bias", f"{ours}.dt_bias_Z"),
        (f"{hf}.A_log", f"{ours}.A_log_ZJ"),
        (f"{hf}.D", f"{ours}.D_Z"),
        (f"{hf}.out_proj.weight", f"{ours}.out_proj_ZD", "linear"),
        (f"{hf}.out_proj.bias", f"{ours}.out_proj_bias_D"),
    ]


_L = "backbone.layers.{i}"
MAMBA = Mapping(
    prefix="backbone.",
    rules=table(
        ("backbone.embeddings.weight", "embed.tokens.embedding_VD"),
        ("backbone.norm_f.weight", "decoder.final_norm.scale_D"),
        ("lm_head.weight", "head.head_DV", "linear"),
        (
            f"{_L}.norm.weight",
            ("decoder.layers.{i}.attn_norm.scale_D", "decoder.layers.{i}.ffn_norm.scale_D"),
            "norm_and_unused",
        ),
        mamba_rows(f"{_L}.mixer", "decoder.layers.{i}.attn"),
    ),
    ignore=("lm_head.weight",),
)


def mamba_writer(cfg):
    """Every layer one ``mamba`` mixer with no FFN."""
    mixers = single_mixers(cfg, "Mamba", {"mamba": None})
    if any(k.ffn_variant != "none" for k in stack_plan(cfg, cfg.n_layers).kinds):
        raise ValueError("ffn_variant: Mamba's layers have no FFN ('none')")
    if cfg.arch != "decoder":
        raise ValueError(f"arch={cfg.arch!r}: export-hf writes decoder-only models")
    s = mixers[0].mixer_settings.resolved(cfg)
    if s.inner_norms:
        raise ValueError("mixer_settings.inner_norms: Mamba has no norms on dt, B and C")
    return {
        "model_type": "mamba",
        "architectures": ["MambaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "state_size": s.state_size,
        "expand": s.expand,
        "conv_kernel": s.conv_kernel,
        "time_step_rank": s.dt_rank,
        "use_bias": s.use_bias,
        "use_conv_bias": s.use_conv_bias,
        "time_step_min": s.time_step_min,
        "time_step_max": s.time_step_max,
        "time_step_floor": s.time_step_floor,
        "layer_norm_epsilon": cfg.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_id,
        "dtype": "float32",
    }


register_family(
    Family("mamba", config=mamba, mapping=MAMBA, write=mamba_writer, architectures=("Mamba",))
)
