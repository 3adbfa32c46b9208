"""Mamba-2 (SSD, "Transformers are SSMs", Dao and Gu 2024), ``mixer="mamba2"``, as
transformers' ``Mamba2Mixer`` (and the Mamba-2 layers of Nemotron-H, Bamba, Falcon-H1)::

    z, xBC, dt = in_proj(x)             fused: I gates, I + 2GJ conv inputs, N steps
    x, B, C = silu(conv1d(xBC))                     short causal depthwise convolution
    dt = softplus(dt + dt_bias),  A = -exp(A_log)   (dt clipped to [dt_limit_min, dt_limit_max])
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t
    out = out_proj(RMSNorm_grouped(y * silu(z)))    the gated RMSNorm, per group

``I = expand * d_model = num_heads * head_dim`` (the inner width; ``d_inner`` sets it apart
from ``expand``, Falcon-H1's ``mamba_d_ssm``), ``J`` the state size, ``G`` the groups whose
B and C the heads share. ``norm`` places the gate: ``"gate_then_norm"`` as above (Mamba-2),
``"norm_then_gate"`` (``RMSNorm_grouped(y) * silu(z)``) or ``"none"`` (``y * silu(z)``, no
norm and no ``norm_scale_Z``; Falcon-H1's ``mamba_rms_norm`` false). Parameters, laid out
as transformers' so a checkpoint maps by name and shape: ``in_proj_DZ``
(``in_proj.weight.T``, ``[D, 2I + 2GJ + N]``) and ``in_proj_bias_Z`` (with ``use_bias``),
``conv_WZ`` (``conv1d.weight[:, 0].T``, ``[W, I + 2GJ]``) and ``conv_bias_Z`` (with
``use_conv_bias``), ``dt_bias_N``, ``A_log_N``, ``D_N``, ``norm_scale_Z`` (``norm.weight``),
``out_proj_ZD`` (and ``out_proj_bias_D``). The norm's eps is ``ModelConfig.norm_eps``.

Cache (``attnlab.nn.mixers.recurrent``): ``"state"`` ``[N, head_dim, J]`` and ``"conv"``
``[W - 1, I + 2GJ]``, in ``state_dtype``. The three forms are ``attnlab.ops.ssd``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import MixerCall, register_mixer
from attnlab.nn import probe
from attnlab.nn.layers import normal
from attnlab.nn.mixers.recurrent import (
    RecurrentMixer,
    RecurrentSettings,
    carried_conv,
    check_positive,
    conv_uniform,
    from_resolved,
    time_step_bias,
    token_validity,
)
from attnlab.ops import ssd
from attnlab.ops.linear import add_bias, dense
from attnlab.ops.precision import upcast
from attnlab.ops.recurrent import gated_rms_norm

NORMS = ("gate_then_norm", "norm_then_gate", "none")


@register_mixer("mamba2")
class Mamba2(RecurrentMixer):
    """Mamba-2's selective state space layer (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(RecurrentSettings):
        expand: int = 2  # the inner width I = expand * d_model
        head_dim: int | None = None  # None: ModelConfig.head_dim
        num_heads: int | None = None  # None: I // head_dim
        d_inner: int | None = None  # the inner width I; None: expand * d_model
        norm: str = "gate_then_norm"  # or "norm_then_gate", "none" (module docstring)
        state_size: int = 128  # J
        n_groups: int = 1  # G: heads sharing one B and C
        use_conv_bias: bool = True
        use_bias: bool = False  # biases on in_proj and out_proj
        dt_limit_min: float = 0.0  # dt is clipped to [dt_limit_min, dt_limit_max]
        dt_limit_max: float | None = None  # None: no upper limit
        time_step_min: float = 0.001  # dt's initial range (dt_bias = softplus^-1(dt))
        time_step_max: float = 0.1
        time_step_floor: float = 1e-4

        def resolved(self, cfg) -> Mamba2.Settings:
            """The settings with the fields left None derived from ``cfg``."""
            head_dim = self.head_dim or cfg.head_dim
            inner = self.d_inner or self.expand * cfg.d_model
            heads = self.num_heads or inner // head_dim
            return dataclasses.replace(self, head_dim=head_dim, num_heads=heads, d_inner=inner)

        def validate(self, cfg) -> None:
            super().validate(cfg)
            for field in ("head_dim", "num_heads", "d_inner"):
                check_positive(self, field)
            if self.norm not in NORMS:
                self.fail("norm", f"one of {NORMS}")
            for field in ("expand", "state_size", "n_groups"):
                check_positive(self, field, allow_none=False)
            s = self.resolved(cfg)
            if s.num_heads * s.head_dim != s.d_inner:
                inner = f"the inner width {s.d_inner} (d_inner, else expand * d_model)"
                self.fail("num_heads", f"num_heads * head_dim = {inner}")
            if s.num_heads % self.n_groups:
                self.fail("n_groups", f"a divisor of num_heads={s.num_heads}")
            if not 0 < self.time_step_min <= self.time_step_max:
                self.fail("time_step_min", "0 < time_step_min <= time_step_max")
            top = self.dt_limit_max
            if not (self.dt_limit_min >= 0 and (top is None or top > self.dt_limit_min)):
                self.fail("dt_limit_max", "above dt_limit_min >= 0, or None for no limit")

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        s = (settings or self.Settings()).resolved(cfg)
        self.settings, self.eps = s, cfg.norm_eps
        D, N, inner, W = cfg.d_model, s.num_heads, s.d_inner, s.conv_kernel
        Z = self.conv_channels(cfg, s)
        pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, pd))
        self.in_proj_DZ = normal(rngs, (D, inner + Z + N), std, pd)
        self.in_proj_bias_Z = zeros(inner + Z + N) if s.use_bias else None
        self.conv_WZ = nnx.Param(conv_uniform(rngs.params(), (W, Z), W, pd))
        self.conv_bias_Z = zeros(Z) if s.use_conv_bias else None
        self.dt_bias_N = nnx.Param(time_step_bias(
            rngs.params(), N, s.time_step_min, s.time_step_max, s.time_step_floor, pd
        ))  # fmt: skip
        self.A_log_N = nnx.Param(jnp.log(jnp.arange(1, N + 1, dtype=jnp.float32)).astype(pd))
        self.D_N = nnx.Param(jnp.ones((N,), pd))
        self.norm_scale_Z = nnx.Param(jnp.ones((inner,), pd)) if s.norm != "none" else None
        self.out_proj_ZD = normal(rngs, (inner, D), std / (2 * cfg.n_layers) ** 0.5, pd)
        self.out_proj_bias_D = zeros(D) if s.use_bias else None

    def gate(self, y_BTZ, z_BTZ):
        """``y`` gated by ``silu(z)``, normed as ``settings.norm`` says."""
        s = self.settings
        if s.norm == "none":
            return y_BTZ * jax.nn.silu(upcast(z_BTZ))
        return gated_rms_norm(
            y_BTZ, z_BTZ, self.norm_scale_Z[...], eps=self.eps,
            group_size=s.d_inner // s.n_groups, norm_before_gate=s.norm == "norm_then_gate",
        )  # fmt: skip

    state_shape = from_resolved(lambda s: (s.num_heads, s.head_dim, s.state_size))
    conv_channels = from_resolved(lambda s: s.d_inner + 2 * s.n_groups * s.state_size)

    def steps(self, dt_BTN, valid_BT):
        """``dt`` after softplus and the limits, in float32; 0 where a token is not real."""
        s = self.settings
        bias_11N = upcast(self.dt_bias_N[...])[None, None, :]
        dt_BTN = jax.nn.softplus(upcast(dt_BTN) + bias_11N)
        dt_BTN = jnp.clip(dt_BTN, s.dt_limit_min, s.dt_limit_max)
        return dt_BTN if valid_BT is None else jnp.where(valid_BT[..., None], dt_BTN, 0.0)

    def __call__(self, x_BTD, call: MixerCall):
        s = self.settings
        B, T, _ = x_BTD.shape
        N, P, G, J = s.num_heads, s.head_dim, s.n_groups, s.state_size
        inner = N * P
        valid_BT = token_validity(call, T)
        if valid_BT is not None:
            x_BTD = jnp.where(valid_BT[..., None], x_BTD, jnp.zeros_like(x_BTD))
        proj_BTZ = dense(x_BTD, self.in_proj_DZ[...])
        if self.in_proj_bias_Z is not None:
            proj_BTZ = add_bias(proj_BTZ, self.in_proj_bias_Z[...])
        z_BTZ, xbc_BTZ, dt_BTN = jnp.split(proj_BTZ, [inner, 2 * inner + 2 * G * J], axis=-1)
        bias = None if self.conv_bias_Z is None else self.conv_bias_Z[...]
        cache, xbc_BTZ = carried_conv(xbc_BTZ, call, valid_BT, self.conv_WZ[...], bias)
        xbc_BTZ = jax.nn.silu(upcast(xbc_BTZ))
        x_BTZ, b_BTZ, c_BTZ = jnp.split(xbc_BTZ, [inner, inner + G * J], axis=-1)
        x_BTNH = x_BTZ.reshape(B, T, N, P)
        groups = lambda y: jnp.repeat(y.reshape(B, T, G, J), N // G, axis=2)
        A_N = -jnp.exp(upcast(self.A_log_N[...]))
        args = (x_BTNH, self.steps(dt_BTN, valid_BT), A_N, groups(b_BTZ), groups(c_BTZ))
        state = self.initial_state(call)
        if cache is not None and T == 1:  # a decode step
            x, dt, _, b, c = (a[:, 0] if a.ndim > 1 else a for a in args)
            y_BNH, state = ssd.ssd_step(x, dt, A_N, b, c, state)
            y_BTNH = y_BNH[:, None]
        elif s.form == "recurrent":
            y_BTNH, state = ssd.ssd_recurrent(*args, state)
        else:
            y_BTNH, state = ssd.ssd_chunked(*args, state, chunk_size=s.chunk_size)
        probe.record("state", state)  # the final recurrent state, read-only
        if cache is not None:
            cache = cache.put("state", state)
        y_BTNH = y_BTNH + upcast(self.D_N[...])[None, None, :, None] * x_BTNH
        y_BTZ = self.gate(y_BTNH.reshape(B, T, inner), z_BTZ)
        out_BTD = dense(y_BTZ.astype(x_BTD.dtype), self.out_proj_ZD[...])
        if self.out_proj_bias_D is not None:
            out_BTD = add_bias(out_BTD, self.out_proj_bias_D[...])
        return out_BTD, cache, None
