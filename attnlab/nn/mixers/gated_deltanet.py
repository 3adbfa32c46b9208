"""Gated DeltaNet ("Gated Delta Networks", Yang et al. 2024), ``mixer="gated_deltanet"``, as
Qwen3-Next's linear-attention layer (transformers' ``Qwen3NextGatedDeltaNet``)::

    q, k, v, z, b, a = in_proj(x)                  (fused, grouped by key head)
    q, k, v = silu(conv1d([q ; k ; v]))             short causal depthwise convolution
    q, k = l2norm(q) / sqrt(Hk_dim), l2norm(k)      each key head serves Hv / Hk value heads
    beta = sigmoid(b),  g = -exp(A_log) softplus(a + dt_bias)
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
    out = out_proj(RMSNorm(o) * silu(z))            the gated RMSNorm, per value head

Parameters, laid out as transformers' so a checkpoint maps by name and shape (``K`` the key
heads, ``N`` the value heads, ``H``/``J`` the key/value head widths, ``r = N / K``):
``in_proj_qkvz_DKH`` ``[D, K, 2H + 2rJ]`` (per key head: q, k, r values, r gates; the
transpose of ``in_proj_qkvz.weight``, split by key head), ``in_proj_ba_DKH`` ``[D, K, 2r]``,
``conv_WZ`` ``[W, 2KH + NJ]`` (``conv1d.weight[:, 0].T``, channels q, k, v), ``A_log_N``,
``dt_bias_N``, ``norm_scale_J`` (``norm.weight``) and ``out_proj_NJD``. The norm's eps is
``ModelConfig.norm_eps``.

Cache (``attnlab.nn.mixers.recurrent``): ``"state"`` ``[N, H, J]`` and ``"conv"`` ``[W - 1,
2KH + NJ]``, in ``state_dtype``. The three forms are ``attnlab.ops.deltanet``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
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
from attnlab.ops import deltanet
from attnlab.ops.linear import dense
from attnlab.ops.precision import upcast
from attnlab.ops.recurrent import gated_rms_norm, l2_normalize


@register_mixer("gated_deltanet")
class GatedDeltaNet(RecurrentMixer):
    """Gated DeltaNet, as in Qwen3-Next (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(RecurrentSettings):
        num_v_heads: int | None = None  # value heads N (None: ModelConfig.n_heads)
        num_k_heads: int | None = None  # key heads K, dividing N (None: N)
        head_k_dim: int | None = None  # key head width H (None: ModelConfig.head_dim)
        head_v_dim: int | None = None  # value head width J (None: ModelConfig.head_dim)

        def resolved(self, cfg) -> GatedDeltaNet.Settings:
            """The settings with the fields left None derived from ``cfg``."""
            n_v = self.num_v_heads or cfg.n_heads
            return dataclasses.replace(
                self,
                num_v_heads=n_v,
                num_k_heads=self.num_k_heads or n_v,
                head_k_dim=self.head_k_dim or cfg.head_dim,
                head_v_dim=self.head_v_dim or cfg.head_dim,
            )

        def validate(self, cfg) -> None:
            super().validate(cfg)
            for field in ("num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim"):
                check_positive(self, field)
            s = self.resolved(cfg)
            if s.num_v_heads % s.num_k_heads:
                self.fail("num_k_heads", f"a divisor of num_v_heads={s.num_v_heads}")

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        s = (settings or self.Settings()).resolved(cfg)
        self.settings, self.eps = s, cfg.norm_eps
        D, K, N, H, J = cfg.d_model, s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
        r, W, pd, std = N // K, s.conv_kernel, cfg.param_dtype, cfg.init_std
        Z = 2 * K * H + N * J
        self.in_proj_qkvz_DKH = normal(rngs, (D, K, 2 * H + 2 * r * J), std, pd)
        self.in_proj_ba_DKH = normal(rngs, (D, K, 2 * r), std, pd)
        self.conv_WZ = nnx.Param(conv_uniform(rngs.params(), (W, Z), W, jnp.dtype(pd)))
        decay = jax.random.uniform(rngs.params(), (N,), jnp.float32, 0.01, 16.0)
        self.A_log_N = nnx.Param(jnp.log(decay).astype(pd))
        # transformers' layer starts dt_bias at 1 (a checkpoint overwrites it); from scratch,
        # softplus(1) ~ 1.3 makes every head forget within a few tokens, so it starts as
        # FLA's and Mamba's: time steps log-uniform in [0.001, 0.1].
        self.dt_bias_N = nnx.Param(time_step_bias(rngs.params(), N, dtype=pd))
        self.norm_scale_J = nnx.Param(jnp.ones((J,), jnp.dtype(pd)))
        self.out_proj_NJD = normal(rngs, (N, J, D), std / (2 * cfg.n_layers) ** 0.5, pd)

    @classmethod
    def inherit(cls, cfg, settings, old, new):
        """From softmax attention's projections (``q_DNH``, ``k_DKH``, ``v_DKH``, ``o_NHD``):
        q and k (each key head from query head / its key-value head) when ``num_k_heads``
        is the attention's query heads and ``head_k_dim`` its head width; v (each value
        head from its query head's key-value head) and the output projection when
        ``num_v_heads`` and ``head_v_dim`` are. The gate z, b, a, the convolution, the
        decay and the norm stay fresh."""
        if not {"q_DNH", "k_DKH", "v_DKH", "o_NHD"} <= set(old):
            return {}
        s = settings.resolved(cfg)
        K, N, H, J = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
        q_DNH, k_DKH, v_DKH, o_NHD = (old[k] for k in ("q_DNH", "k_DKH", "v_DKH", "o_NHD"))
        Nq, Hq, G = q_DNH.shape[1], q_DNH.shape[2], q_DNH.shape[1] // k_DKH.shape[1]
        qkvz = np.array(new["in_proj_qkvz_DKH"])  # per key head: q, k, r values, r gates
        out = {}
        if (Nq, Hq) == (K, H):
            qkvz[:, :, :H] = q_DNH
            qkvz[:, :, H : 2 * H] = np.repeat(k_DKH, G, axis=1)
            out["in_proj_qkvz_DKH"] = qkvz
        if (Nq, Hq) == (N, J):
            r = N // K
            v_DNJ = np.repeat(v_DKH, G, axis=1)  # value head n: query head n's kv head
            qkvz[:, :, 2 * H : 2 * H + r * J] = v_DNJ.reshape(v_DNJ.shape[0], K, r * J)
            out["in_proj_qkvz_DKH"] = qkvz
            out["out_proj_NJD"] = np.asarray(o_NHD)
        return out

    state_shape = from_resolved(lambda s: (s.num_v_heads, s.head_k_dim, s.head_v_dim))
    conv_channels = from_resolved(
        lambda s: 2 * s.num_k_heads * s.head_k_dim + s.num_v_heads * s.head_v_dim
    )

    def project(self, x_BTD):
        """``(mixed_BTZ, z_BTNJ, b_BTN, a_BTN)``: the fused projections split as
        transformers' ``fix_query_key_value_ordering``, q, k and v joined for the conv."""
        s = self.settings
        B, T, _ = x_BTD.shape
        K, N, H, J = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
        r = N // K
        qkvz_BTKH = dense(x_BTD, self.in_proj_qkvz_DKH[...])
        q, k, v, z = jnp.split(qkvz_BTKH, [H, 2 * H, 2 * H + r * J], axis=-1)
        b_BTKH, a_BTKH = jnp.split(dense(x_BTD, self.in_proj_ba_DKH[...]), [r], axis=-1)
        flat = lambda y: y.reshape(B, T, -1)
        mixed_BTZ = jnp.concatenate([flat(q), flat(k), flat(v)], axis=-1)
        return mixed_BTZ, z.reshape(B, T, N, J), flat(b_BTKH), flat(a_BTKH)

    def gates(self, b_BTN, a_BTN, valid_BT):
        """``(g_BTN, beta_BTN)`` in float32; a token that is not real gets 0 and 0."""
        beta_BTN = jax.nn.sigmoid(upcast(b_BTN))
        per_head = lambda p: upcast(p[...])[None, None, :]
        dt_BTN = jax.nn.softplus(upcast(a_BTN) + per_head(self.dt_bias_N))
        g_BTN = -jnp.exp(per_head(self.A_log_N)) * dt_BTN
        if valid_BT is not None:
            g_BTN = jnp.where(valid_BT[..., None], g_BTN, 0.0)
            beta_BTN = jnp.where(valid_BT[..., None], beta_BTN, 0.0)
        return g_BTN, beta_BTN

    def __call__(self, x_BTD, call: MixerCall):
        s = self.settings
        B, T, _ = x_BTD.shape
        K, N, H, J = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
        valid_BT = token_validity(call, T)
        if valid_BT is not None:
            x_BTD = jnp.where(valid_BT[..., None], x_BTD, jnp.zeros_like(x_BTD))
        mixed_BTZ, z_BTNJ, b_BTN, a_BTN = self.project(x_BTD)
        cache, mixed_BTZ = carried_conv(mixed_BTZ, call, valid_BT, self.conv_WZ[...])
        mixed_BTZ = jax.nn.silu(upcast(mixed_BTZ))
        q, k, v = jnp.split(mixed_BTZ, [K * H, 2 * K * H], axis=-1)
        heads = lambda y: jnp.repeat(l2_normalize(y.reshape(B, T, K, H)), N // K, axis=2)
        q_BTNH, k_BTNH = heads(q) * H**-0.5, heads(k)
        v_BTNJ = v.reshape(B, T, N, J)
        g_BTN, beta_BTN = self.gates(b_BTN, a_BTN, valid_BT)
        o_BTNJ, state = deltanet.delta_rule(
            q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN, self.initial_state(call),
            step=cache is not None and T == 1, form=s.form, chunk_size=s.chunk_size,
        )  # fmt: skip
        probe.record("state", state)  # the final recurrent state, read-only
        if cache is not None:
            cache = cache.put("state", state)
        o_BTNJ = gated_rms_norm(o_BTNJ, z_BTNJ, self.norm_scale_J[...], eps=self.eps)
        return dense(o_BTNJ.astype(x_BTD.dtype), self.out_proj_NJD[...], n_in=2), cache, None
