"""Mamba-1 checkpoints (``MambaForCausalLM``): every layer is ``norm -> MambaMixer ->
residual`` with no MLP, built as a pre-norm decoder of ``mamba`` mixers (parameters in
transformers' layout) with ``ffn_variant="none"`` and no positions, as Mamba-2's."""

from __future__ import annotations

import math

from attnlab.pretrained.families.mamba2 import (
    ssm_config_json,
    ssm_decoder,
    ssm_mapping,
    ssm_mixer_settings,
    ssm_rows,
)
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import reject, require


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
    return ssm_decoder(c, "mamba", mamba_settings, tie=True)


def mamba_rows(hf: str, ours: str) -> list:
    """Table rows of one Mamba-1 mixer: transformers' ``hf`` -> attnlab's ``ours``."""
    return ssm_rows(
        hf,
        ours,
        (f"{hf}.x_proj.weight", f"{ours}.x_proj_ZR", "linear"),
        (f"{hf}.dt_proj.weight", f"{ours}.dt_proj_RZ", "linear"),
        (f"{hf}.dt_proj.bias", f"{ours}.dt_bias_Z"),
        (f"{hf}.A_log", f"{ours}.A_log_ZJ"),
        (f"{hf}.D", f"{ours}.D_Z"),
    )


MAMBA = ssm_mapping(mamba_rows)


def mamba_writer(cfg):
    """Every layer one ``mamba`` mixer with no FFN."""
    s = ssm_mixer_settings(cfg, "Mamba", "mamba")
    if s.inner_norms:
        raise ValueError("mixer_settings.inner_norms: Mamba has no norms on dt, B and C")
    keys = {
        "state_size": s.state_size,
        "expand": s.expand,
        "conv_kernel": s.conv_kernel,
        "time_step_rank": s.dt_rank,
        "use_bias": s.use_bias,
        "use_conv_bias": s.use_conv_bias,
    }
    return ssm_config_json(cfg, s, "mamba", keys)


register_family(
    Family("mamba", config=mamba, mapping=MAMBA, write=mamba_writer, architectures=("Mamba",))
)
