"""Mamba-1 (Gu and Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces"), ``mixer="mamba"``, as transformers' ``MambaMixer`` (and Jamba's Mamba layers)::

    x, z = in_proj(x)                         the inner width Z = expand * d_model, twice
    x = silu(conv1d(x))                       short causal depthwise convolution
    dt, B, C = x_proj(x)                      a rank-R step, and B, C of the state size J
    dt = softplus(dt_proj(dt)),  A = -exp(A_log)              (per channel; A [Z, J])
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t + D x_t   (ops.selective_scan)
    out = out_proj(y * silu(z))

``inner_norms`` (Jamba) RMS-normalises dt, B and C (``dt_norm_R``, ``b_norm_J``,
``c_norm_J``; eps ``ModelConfig.norm_eps``) before they are used. Parameters, laid out as
transformers' so a checkpoint maps by name and shape: ``in_proj_DZ`` (``[D, 2Z]``: x then
z) and ``in_proj_bias_Z`` (with ``use_bias``), ``conv_WZ`` and ``conv_bias_Z`` (with
``use_conv_bias``), ``x_proj_ZR`` (``[Z, R + 2J]``), ``dt_proj_RZ`` and ``dt_bias_Z``,
``A_log_ZJ``, ``D_Z``, ``out_proj_ZD`` (and ``out_proj_bias_D``).

Cache (``attnlab.nn.mixers.recurrent``): ``"state"`` ``[Z, J]`` and ``"conv"`` ``[W - 1, Z]``
in ``state_dtype``; ``form`` picks the chunked or the recurrent scan for training and
prefill, a decode step is ``selective_scan_step``. A token that is not real has ``dt = 0``
and leaves the state as it was.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import CacheEntry, MixerCall, register_mixer
from attnlab.nn.layers import normal
from attnlab.nn.mixers.recurrent import (
    RecurrentMixer,
    RecurrentSettings,
    carried_conv,
    check_positive,
    conv_uniform,
    time_step_bias,
    token_validity,
)
from attnlab.ops import selective_scan as scan
from attnlab.ops.linear import add_bias, dense
from attnlab.ops.norms import rms_norm
from attnlab.ops.precision import upcast


@register_mixer("mamba")
class Mamba(RecurrentMixer):
    """Mamba-1's selective state space layer (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(RecurrentSettings):
        expand: int = 2  # the inner width Z = expand * d_model
        state_size: int = 16  # J
        dt_rank: int | None = None  # R; None: ceil(d_model / 16)
        use_conv_bias: bool = True
        use_bias: bool = False  # biases on in_proj and out_proj
        inner_norms: bool = False  # RMSNorms on dt, B and C (Jamba)
        time_step_min: float = 0.001  # dt's initial range (dt_bias = softplus^-1(dt))
        time_step_max: float = 0.1
        time_step_floor: float = 1e-4

        def resolved(self, cfg) -> Mamba.Settings:
            """The settings with ``dt_rank`` derived from ``cfg`` when None."""
            return dataclasses.replace(self, dt_rank=self.dt_rank or math.ceil(cfg.d_model / 16))

        def validate(self, cfg) -> None:
            super().validate(cfg)
            check_positive(self, "dt_rank")
            for field in ("expand", "state_size"):
                check_positive(self, field, allow_none=False)
            for field in ("use_conv_bias", "use_bias", "inner_norms"):
                if not isinstance(getattr(self, field), bool):
                    self.fail(field, "True or False")
            if not 0 < self.time_step_min <= self.time_step_max:
                self.fail("time_step_min", "0 < time_step_min <= time_step_max")

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        s = (settings or self.Settings()).resolved(cfg)
        self.settings, self.eps = s, cfg.norm_eps
        D, Z, J, R, W = cfg.d_model, s.expand * cfg.d_model, s.state_size, s.dt_rank, s.conv_kernel
        pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, pd))
        ones = lambda n: nnx.Param(jnp.ones((n,), pd))
        self.in_proj_DZ = normal(rngs, (D, 2 * Z), std, pd)
        self.in_proj_bias_Z = zeros(2 * Z) if s.use_bias else None
        self.conv_WZ = nnx.Param(conv_uniform(rngs.params(), (W, Z), W, pd))
        self.conv_bias_Z = zeros(Z) if s.use_conv_bias else None
        self.x_proj_ZR = normal(rngs, (Z, R + 2 * J), std, pd)
        self.dt_proj_RZ = normal(rngs, (R, Z), R**-0.5, pd)
        self.dt_bias_Z = nnx.Param(time_step_bias(
            rngs.params(), Z, s.time_step_min, s.time_step_max, s.time_step_floor, pd
        ))  # fmt: skip
        A = jnp.broadcast_to(jnp.arange(1, J + 1, dtype=jnp.float32)[None, :], (Z, J))
        self.A_log_ZJ = nnx.Param(jnp.log(A).astype(pd))
        self.D_Z = ones(Z)
        self.dt_norm_R, self.b_norm_J, self.c_norm_J = (
            (ones(R), ones(J), ones(J)) if s.inner_norms else (None, None, None)
        )
        self.out_proj_ZD = normal(rngs, (Z, D), std / (2 * cfg.n_layers) ** 0.5, pd)
        self.out_proj_bias_D = zeros(D) if s.use_bias else None

    @classmethod
    def cache_entries(cls, cfg, settings):
        s = (settings or cls.Settings()).resolved(cfg)
        Z = s.expand * cfg.d_model
        return {
            "state": CacheEntry((Z, s.state_size), s.state_dtype, (None, None)),
            "conv": CacheEntry((s.conv_kernel - 1, Z), s.state_dtype, (None, None)),
        }

    def _norm(self, x, scale):
        return x if scale is None else rms_norm(x, upcast(scale[...]), eps=self.eps)

    def __call__(self, x_BTD, call: MixerCall):
        s = self.settings
        T = x_BTD.shape[1]
        R, J = s.dt_rank, s.state_size
        valid_BT = token_validity(call, T)
        proj_BTZ = dense(x_BTD, self.in_proj_DZ[...])
        if self.in_proj_bias_Z is not None:
            proj_BTZ = add_bias(proj_BTZ, self.in_proj_bias_Z[...])
        x_BTZ, z_BTZ = jnp.split(proj_BTZ, 2, axis=-1)
        bias = None if self.conv_bias_Z is None else self.conv_bias_Z[...]
        cache, x_BTZ = carried_conv(x_BTZ, call, valid_BT, self.conv_WZ[...], bias)
        x_BTZ = jax.nn.silu(upcast(x_BTZ))
        params_BTZ = dense(x_BTZ, upcast(self.x_proj_ZR[...]))
        dt_BTR, b_BTJ, c_BTJ = jnp.split(params_BTZ, [R, R + J], axis=-1)
        dt_BTR = self._norm(dt_BTR, self.dt_norm_R)
        b_BTJ, c_BTJ = self._norm(b_BTJ, self.b_norm_J), self._norm(c_BTJ, self.c_norm_J)
        dt_BTZ = dense(dt_BTR, upcast(self.dt_proj_RZ[...]))
        dt_BTZ = jax.nn.softplus(dt_BTZ + upcast(self.dt_bias_Z[...])[None, None, :])
        if valid_BT is not None:
            dt_BTZ = jnp.where(valid_BT[..., None], dt_BTZ, 0.0)
        A_ZJ = -jnp.exp(upcast(self.A_log_ZJ[...]))
        state = self.initial_state(call)
        if cache is not None and T == 1:  # a decode step
            y_BZ, state = scan.selective_scan_step(
                x_BTZ[:, 0], dt_BTZ[:, 0], A_ZJ, b_BTJ[:, 0], c_BTJ[:, 0], state
            )
            y_BTZ = y_BZ[:, None]
        elif s.form == "recurrent":
            y_BTZ, state = scan.selective_scan_recurrent(x_BTZ, dt_BTZ, A_ZJ, b_BTJ, c_BTJ, state)
        else:
            y_BTZ, state = scan.selective_scan_chunked(
                x_BTZ, dt_BTZ, A_ZJ, b_BTJ, c_BTJ, state, chunk_size=s.chunk_size
            )
        if cache is not None:
            cache = cache.put("state", state)
        y_BTZ = (y_BTZ + upcast(self.D_Z[...])[None, None, :] * x_BTZ) * jax.nn.silu(upcast(z_BTZ))
        out_BTD = dense(y_BTZ.astype(x_BTD.dtype), self.out_proj_ZD[...])
        if self.out_proj_bias_D is not None:
            out_BTD = add_bias(out_BTD, self.out_proj_bias_D[...])
        return out_BTD, cache, None
