"""State-space checkpoints: transformers' ``Mamba2ForCausalLM``, its config.json translator
and tensor-name table.

Every layer is ``norm -> Mamba2Mixer -> residual`` with no MLP: attnlab builds it as a
pre-norm decoder whose mixer is ``mamba2`` (``attnlab.nn.mixers.mamba2``, parameters in
transformers' layout) and whose FFN is ``ffn_variant="none"``. There are no positions; the
attention fields of the ``ModelConfig`` (heads, ``d_ff``) size nothing.
"""

from __future__ import annotations

import math

from attnlab.pretrained.hf_base import common_fields, reject, require
from attnlab.pretrained.mappings import Mapping, _table

# Mamba-2 keeps no positions; a cache of a recurrent layer does not grow with it either.
MAMBA2_MAX_LEN = 1 << 20


def _chunk_size(c: dict) -> int:
    """transformers' chunk size when a power of two (it changes no output), else 64."""
    size = c.get("chunk_size") or 64
    return size if size & (size - 1) == 0 else 64


def _number(v) -> float:
    """A float of config.json; transformers 5 writes infinity as ``{"__float__": "Infinity"}``."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def _dt_limit(c: dict) -> tuple[float, float | None]:
    low, high = (_number(v) for v in c.get("time_step_limit") or (0.0, math.inf))
    return low, None if math.isinf(high) else high


def mamba2(c: dict) -> dict:
    """``Mamba2Config`` -> a decoder of ``mamba2`` layers without FFN."""
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Mamba-2 gates with silu only")
    reject(c, "rms_norm", lambda v: v is False, "the gated RMSNorm is always applied")
    D = require(c, "hidden_size")
    low, high = _dt_limit(c)
    settings = {
        "expand": c.get("expand", 2),
        "head_dim": c.get("head_dim", 64),
        "num_heads": require(c, "num_heads"),
        "state_size": c.get("state_size", 128),
        "n_groups": c.get("n_groups", 1),
        "conv_kernel": c.get("conv_kernel", 4),
        "chunk_size": _chunk_size(c),
        "use_conv_bias": bool(c.get("use_conv_bias", True)),
        "use_bias": bool(c.get("use_bias", False)),
        "dt_limit_min": low,
        "dt_limit_max": high,
        "time_step_min": float(c.get("time_step_min", 0.001)),
        "time_step_max": float(c.get("time_step_max", 0.1)),
        "time_step_floor": float(c.get("time_step_floor", 1e-4)),
    }
    return common_fields(
        c,
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=D,
        n_layers=require(c, "num_hidden_layers"),
        n_heads=1,
        max_len=MAMBA2_MAX_LEN,
        position="none",
        norm="rmsnorm",
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        norm_placement="pre",
        final_norm=True,
        mixer="mamba2",
        mixer_settings=settings,
        ffn_variant="none",
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


_L = "backbone.layers.{i}"
_M = "decoder.layers.{i}.attn"
MAMBA2 = Mapping(
    prefix="backbone.",
    rules=_table(
        ("backbone.embeddings.weight", "embed.tokens.embedding_VD"),
        ("backbone.norm_f.weight", "decoder.final_norm.scale_D"),
        ("lm_head.weight", "head.head_DV", "linear"),
        (
            f"{_L}.norm.weight",
            ("decoder.layers.{i}.attn_norm.scale_D", "decoder.layers.{i}.ffn_norm.scale_D"),
            "norm_and_unused",
        ),
        (f"{_L}.mixer.in_proj.weight", f"{_M}.in_proj_DZ", "linear"),
        (f"{_L}.mixer.in_proj.bias", f"{_M}.in_proj_bias_Z"),
        (f"{_L}.mixer.conv1d.weight", f"{_M}.conv_WZ", "depthwise_conv"),
        (f"{_L}.mixer.conv1d.bias", f"{_M}.conv_bias_Z"),
        (f"{_L}.mixer.dt_bias", f"{_M}.dt_bias_N"),
        (f"{_L}.mixer.A_log", f"{_M}.A_log_N"),
        (f"{_L}.mixer.D", f"{_M}.D_N"),
        (f"{_L}.mixer.norm.weight", f"{_M}.norm_scale_Z"),
        (f"{_L}.mixer.out_proj.weight", f"{_M}.out_proj_ZD", "linear"),
        (f"{_L}.mixer.out_proj.bias", f"{_M}.out_proj_bias_D"),
    ),
    ignore=("lm_head.weight",),
)
