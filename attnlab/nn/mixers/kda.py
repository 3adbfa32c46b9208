"""Kimi Delta Attention ("Kimi Linear", Moonshot AI 2025), ``mixer="kda"``, as Kimi Linear's
linear-attention layer (transformers' ``KimiLinearDeltaAttention``): Gated DeltaNet with a
forget gate per key channel instead of per head::

    q, k, v = silu(conv1d(W_q x)), silu(conv1d(W_k x)), silu(conv1d(W_v x))   short, causal
    q, k = l2norm(q) / sqrt(H), l2norm(k)
    g = -exp(A_log) softplus(W_fb W_fa x + dt_bias)      one log-decay per key channel
    beta = sigmoid(W_b x)
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
    out = W_o (RMSNorm(o) * sigmoid(W_gb W_ga x))          the gated RMSNorm, per head

Parameters (``N`` heads, ``H`` the head width of q, k and v, ``R`` the rank of the two
low-rank projections): ``q_DNH``, ``k_DNH``, ``v_DNH``; ``q_conv_WZ``, ``k_conv_WZ``,
``v_conv_WZ`` (``[W, NH]`` each, ``*_conv1d.weight[:, 0].T``); the forget gate's ``f_a_DR``,
``f_b_RNH``, ``A_log_N`` and ``dt_bias_NH``; ``beta_DN``; the output gate's ``g_a_DR`` and
``g_b_RNH``; ``norm_scale_H`` and ``o_NHD``. The norm's eps is ``ModelConfig.norm_eps``.

Cache (``attnlab.nn.mixers.recurrent``): ``"state"`` ``[N, H, H]`` and ``"conv"`` ``[W - 1,
3NH]`` (channels q, k, v), in ``state_dtype``. The three forms are ``attnlab.ops.deltanet``'s
with ``g_BTNH``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.contracts.mixer import MixerCall, register_mixer
from attnlab.nn import probe
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
from attnlab.ops import deltanet
from attnlab.ops.linear import dense
from attnlab.ops.precision import upcast
from attnlab.ops.recurrent import gated_rms_norm, l2_normalize


@register_mixer("kda")
class KimiDeltaAttention(RecurrentMixer):
    """Kimi Delta Attention, as in Kimi Linear (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(RecurrentSettings):
        num_heads: int | None = None  # heads N (None: ModelConfig.n_heads)
        head_dim: int | None = None  # head width H of q, k and v (None: ModelConfig.head_dim)
        gate_rank: int | None = None  # rank R of the forget and output gates (None: H)

        def resolved(self, cfg) -> KimiDeltaAttention.Settings:
            """The settings with the fields left None derived from ``cfg``."""
            H = self.head_dim or cfg.head_dim
            return dataclasses.replace(
                self,
                num_heads=self.num_heads or cfg.n_heads,
                head_dim=H,
                gate_rank=self.gate_rank or H,
            )

        def validate(self, cfg) -> None:
            super().validate(cfg)
            for field in ("num_heads", "head_dim", "gate_rank"):
                check_positive(self, field)

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        s = (settings or self.Settings()).resolved(cfg)
        self.settings, self.eps = s, cfg.norm_eps
        D, N, H, R = cfg.d_model, s.num_heads, s.head_dim, s.gate_rank
        W, pd, std = s.conv_kernel, cfg.param_dtype, cfg.init_std
        # One draw from the stream, split for every parameter: each draw updates the
        # stream's count, which costs more than the parameter when a stack is traced.
        keys = iter(jax.random.split(rngs.params(), 14))
        normal = lambda shape, scale=std: nnx.Param(
            scale * jax.random.normal(next(keys), shape, jnp.dtype(pd))
        )
        self.q_DNH, self.k_DNH, self.v_DNH = (normal((D, N, H)) for _ in range(3))
        conv = lambda: conv_uniform(next(keys), (W, N * H), W, jnp.dtype(pd))
        self.q_conv_WZ, self.k_conv_WZ, self.v_conv_WZ = (nnx.Param(conv()) for _ in range(3))
        self.f_a_DR, self.f_b_RNH = normal((D, R)), normal((R, N, H))
        decay = jax.random.uniform(next(keys), (N,), jnp.float32, 1.0, 16.0)  # FLA's
        self.A_log_N = nnx.Param(jnp.log(decay).astype(pd))
        dt = time_step_bias(next(keys), N * H, dtype=pd)
        self.dt_bias_NH = nnx.Param(dt.reshape(N, H))
        self.beta_DN = normal((D, N))
        self.g_a_DR, self.g_b_RNH = normal((D, R)), normal((R, N, H))
        self.norm_scale_H = nnx.Param(jnp.ones((H,), jnp.dtype(pd)))
        self.o_NHD = normal((N, H, D), std / (2 * cfg.n_layers) ** 0.5)

    @classmethod
    def inherit(cls, cfg, settings, old, new):
        """From softmax attention's projections (``q_DNH``, ``k_DKH``, ``v_DKH``): k and v,
        each head from its query head's key-value head, when ``num_heads`` and ``head_dim``
        are the attention's query heads and width (q and o, of the same names and shapes,
        are copied before this is asked). The convolutions, gates and norm stay fresh."""
        if not {"q_DNH", "k_DKH", "v_DKH"} <= set(old) or old["q_DNH"].shape != new["q_DNH"].shape:
            return {}
        G = old["q_DNH"].shape[1] // old["k_DKH"].shape[1]
        return {"k_DNH": np.repeat(old["k_DKH"], G, axis=1),
                "v_DNH": np.repeat(old["v_DKH"], G, axis=1)}  # fmt: skip

    state_shape = from_resolved(lambda s: (s.num_heads, s.head_dim, s.head_dim))
    conv_channels = from_resolved(lambda s: 3 * s.num_heads * s.head_dim)

    def gates(self, x_BTD, valid_BT):
        """``(g_BTNH, beta_BTN)`` in float32; a token that is not real gets 0 and 0."""
        f_BTNH = upcast(dense(dense(x_BTD, self.f_a_DR[...]), self.f_b_RNH[...]))
        dt_BTNH = jax.nn.softplus(f_BTNH + upcast(self.dt_bias_NH[...])[None, None])
        A_N = jnp.exp(upcast(self.A_log_N[...]))
        g_BTNH = -A_N[None, None, :, None] * dt_BTNH
        beta_BTN = jax.nn.sigmoid(upcast(dense(x_BTD, self.beta_DN[...])))
        if valid_BT is not None:
            g_BTNH = jnp.where(valid_BT[..., None, None], g_BTNH, 0.0)
            beta_BTN = jnp.where(valid_BT[..., None], beta_BTN, 0.0)
        return g_BTNH, beta_BTN

    def __call__(self, x_BTD, call: MixerCall):
        s = self.settings
        B, T, _ = x_BTD.shape
        N, H = s.num_heads, s.head_dim
        valid_BT = token_validity(call, T)
        if valid_BT is not None:
            x_BTD = jnp.where(valid_BT[..., None], x_BTD, jnp.zeros_like(x_BTD))
        flat = lambda w: dense(x_BTD, w[...]).reshape(B, T, N * H)
        mixed_BTZ = jnp.concatenate([flat(self.q_DNH), flat(self.k_DNH), flat(self.v_DNH)], -1)
        w_WZ = jnp.concatenate([self.q_conv_WZ[...], self.k_conv_WZ[...], self.v_conv_WZ[...]], 1)
        cache, mixed_BTZ = carried_conv(mixed_BTZ, call, valid_BT, w_WZ)
        mixed_BTZ = jax.nn.silu(upcast(mixed_BTZ))
        q_BTNH, k_BTNH, v_BTNH = (y.reshape(B, T, N, H) for y in jnp.split(mixed_BTZ, 3, -1))
        q_BTNH, k_BTNH = l2_normalize(q_BTNH) * H**-0.5, l2_normalize(k_BTNH)
        g_BTNH, beta_BTN = self.gates(x_BTD, valid_BT)
        o_BTNH, state = deltanet.delta_rule(
            q_BTNH, k_BTNH, v_BTNH, g_BTNH, beta_BTN, self.initial_state(call),
            step=cache is not None and T == 1, form=s.form, chunk_size=s.chunk_size,
        )  # fmt: skip
        probe.record("state", state)  # the final recurrent state, read-only
        if cache is not None:
            cache = cache.put("state", state)
        gate_BTNH = dense(dense(x_BTD, self.g_a_DR[...]), self.g_b_RNH[...])
        o_BTNH = gated_rms_norm(
            o_BTNH, gate_BTNH, self.norm_scale_H[...], eps=self.eps, activation=jax.nn.sigmoid
        )
        return dense(o_BTNH.astype(x_BTD.dtype), self.o_NHD[...], n_in=2), cache, None
