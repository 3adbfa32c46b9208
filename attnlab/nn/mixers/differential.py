"""Differential attention (Ye et al. 2024, "Differential Transformer"), ``mixer="differential"``.

Each of the N heads splits its query and key in two halves of ``d = H / 2`` (``q1, q2``,
``k1, k2``), keeps one value of ``H = 2d`` and attends with the difference of two softmax
maps (the paper's eqs. 1-3, its per-layer λ shared by the layer's heads)::

    head_n = (softmax(q1 k1^T / sqrt(d)) - λ softmax(q2 k2^T / sqrt(d))) v
    λ      = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init
    out    = concat_n[(1 - λ_init) RMSNorm(head_n)] W_o

so the paper's ``h = d_model / 2d`` heads of value width ``2d`` are ``ModelConfig.n_heads``
heads of ``head_dim = 2d``, with the parameters of ``mha`` (``q_DNH``, ``k_DKH``, ``v_DKH``,
``o_NHD``: q/k halves are ``[..., :d]`` and ``[..., d:]``), GQA included, plus the four λ
vectors ``lambda_q1_H`` .. ``lambda_k2_H`` (of the half width d; initialised N(0, 0.1) as
the authors' code does) and the per-head RMSNorm ``head_norm`` (a learned scale of H, eps
``ModelConfig.norm_eps``). RoPE (and QK-norm) act on each half, as a head of width d.

``λ_init`` (``Settings.lambda_init``): a constant, or None for the paper's depth schedule
``0.8 - 0.6 exp(-0.3 (l - 1))`` with ``l - 1`` the layer's index in its stack
(``MixerCall.layer``; 0.8 for a call outside a stack, which has no index).

The logit scale is ``d ** -0.5`` unless ``ModelConfig.attn_scale`` is set. Each map is one
call of the configured score function (``Attention.attend``), so masks, the chunked path and
the mesh's context axis work as for ``mha``; q and k halves are zero-padded to H for it,
which leaves every logit as it is, since the score functions take keys and values of one
shape. With weights asked for, the layer returns the effective map ``A1 - λ A2``.

Cache: ``"keys"`` (the first map's k1) and ``"keys_2"`` (k2), ``[K, S, H/2]`` each, and
``"values"`` ``[K, S, H]``: as many bytes per token as ``mha``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import SLOTS, CacheEntry, MixerCall, MixerSettings, register_mixer
from attnlab.devices.sharding import constrain
from attnlab.errors import ConfigError
from attnlab.nn.layers import Norm
from attnlab.nn.mixers.mha import Attention
from attnlab.ops.linear import fold
from attnlab.ops.precision import wide


def lambda_init_schedule(layer, dtype=jnp.float32):
    """The paper's ``λ_init = 0.8 - 0.6 exp(-0.3 (l - 1))``, ``layer = l - 1`` (0-based)."""
    return 0.8 - 0.6 * jnp.exp(-0.3 * jnp.asarray(layer, dtype))


def _pad_to(x, size):
    """``x`` with zeros appended on its last axis up to ``size``."""
    pad = size - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


@register_mixer("differential")
class DifferentialAttention(Attention):
    """Two softmax maps per head, subtracted with a learned λ (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        lambda_init: float | None = None  # None: the paper's depth schedule

        def validate(self, cfg):
            if self.lambda_init is not None and not (
                isinstance(self.lambda_init, int | float) and 0 <= self.lambda_init < 1
            ):
                self.fail("lambda_init", "a number in [0, 1), or None for the depth schedule")
            rope = cfg.position == "rope"
            if cfg.head_dim % (4 if rope else 2):
                raise ConfigError(
                    f"ModelConfig.head_dim={cfg.head_dim} is invalid: mixer='differential' "
                    "splits each head's q and k in two halves"
                    + (
                        " that RoPE rotates in pairs: use a multiple of 4"
                        if rope
                        else ": use an even size"
                    )
                )

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        settings = settings or self.Settings()
        d = cfg.head_dim // 2
        self.lambda_init = settings.lambda_init
        if self.q_norm is not None:  # QK-norm per half (a head of width d)
            self.q_norm = Norm(cfg, d, rngs=rngs, kind="rmsnorm")
            self.k_norm = Norm(cfg, d, rngs=rngs, kind="rmsnorm")
        pd = jnp.dtype(cfg.param_dtype)
        lam = lambda: nnx.Param(0.1 * jax.random.normal(rngs.params(), (d,), pd))
        self.lambda_q1_H, self.lambda_k1_H = lam(), lam()
        self.lambda_q2_H, self.lambda_k2_H = lam(), lam()
        self.head_norm = Norm(cfg, cfg.head_dim, rngs=rngs, kind="rmsnorm")

    @classmethod
    def cache_entries(cls, cfg, settings):
        K, H = cfg.n_kv_heads, cfg.head_dim
        axes = ("act_kv_heads", None, None)
        half = CacheEntry((K, SLOTS, H // 2), axes=axes)
        return {"keys": half, "keys_2": half, "values": CacheEntry((K, SLOTS, H), axes=axes)}

    def _halves(self, x_BTnH, norm, positions_BT, rope_theta):
        """QK-norm and RoPE on each half of ``x`` (as ``2n`` heads of width ``H / 2``)."""
        B, T, n, H = x_BTnH.shape
        x = x_BTnH.reshape(B, T, 2 * n, H // 2)
        if norm is not None:
            x = norm(x)
        return self._rope(x, positions_BT, rope_theta).reshape(B, T, n, H)

    def query(self, x_BTD, call: MixerCall):
        q_BTNH = self._project(x_BTD, self.q_DNH, self.q_bias_NH)
        q_BTNH = self._halves(q_BTNH, self.q_norm, call.positions_BT, call.rope_theta)
        return constrain(q_BTNH, "batch", "length", "act_heads", None)

    def project_kv(self, x_BSD, positions_BS=None, rope_theta=None):
        k_BSKH = self._project(x_BSD, self.k_DKH, self.k_bias_KH)
        v_BSKH = self._project(x_BSD, self.v_DKH, self.v_bias_KH)
        return self._halves(k_BSKH, self.k_norm, positions_BS, rope_theta), v_BSKH

    def keys_values(self, x_BTD, call: MixerCall):
        """``(cache, (k1_BSKH, k2_BSKH), v_BSKH)``, after what the cache holds when decoding."""
        k_BTKH, v_BTKH = self.project_kv(x_BTD, call.positions_BT, call.rope_theta)
        d = k_BTKH.shape[-1] // 2
        k1_BTKH, k2_BTKH = k_BTKH[..., :d], k_BTKH[..., d:]
        cache = call.cache
        if cache is None:
            return None, (k1_BTKH, k2_BTKH), v_BTKH
        cache, k1_BKSH = cache.append("keys", k1_BTKH)
        cache, k2_BKSH = cache.append("keys_2", k2_BTKH)
        cache, v_BKSH = cache.append("values", v_BTKH)
        k1_BSKH, k2_BSKH, v_BSKH = (jnp.swapaxes(a, 1, 2) for a in (k1_BKSH, k2_BKSH, v_BKSH))
        return cache, (k1_BSKH, k2_BSKH), v_BSKH

    def lambdas(self, call: MixerCall):
        """``(λ, λ_init)`` of this layer, scalars in at least float32."""
        dtype = wide(self.lambda_q1_H[...])
        if self.lambda_init is not None:
            init = jnp.asarray(self.lambda_init, dtype)
        elif call.layer is None:
            init = jnp.asarray(0.8, dtype)
        else:
            init = lambda_init_schedule(call.layer, dtype)
        dot = lambda a, b: jnp.sum(a[...].astype(dtype) * b[...].astype(dtype))
        lam = jnp.exp(dot(self.lambda_q1_H, self.lambda_k1_H))
        lam = lam - jnp.exp(dot(self.lambda_q2_H, self.lambda_k2_H)) + init
        return lam, init

    def __call__(self, x_BTD, call: MixerCall):
        cfg = self.cfg
        H = cfg.head_dim
        d = H // 2
        q_BTNH = self.query(x_BTD, call)
        cache, (k1_BSKH, k2_BSKH), v_BSKH = self.keys_values(x_BTD, call)
        scale = d**-0.5 if "attn_scale" in cfg._derived else cfg.attn_scale
        maps = []
        for i, (q_BTNh, k_BSKh) in enumerate(
            ((q_BTNH[..., :d], k1_BSKH), (q_BTNH[..., d:], k2_BSKH))
        ):
            map_call = call.replace(key=fold(call.key, i))
            maps.append(
                self.attend(_pad_to(q_BTNh, H), _pad_to(k_BSKh, H), v_BSKH, map_call, scale=scale)
            )
        (out1_BTNH, w1_BNTS), (out2_BTNH, w2_BNTS) = maps
        lam, init = self.lambdas(call)
        dt = out1_BTNH.dtype
        head_BTNH = out1_BTNH - lam.astype(dt) * out2_BTNH
        head_BTNH = self.head_norm(head_BTNH) * (1 - init).astype(dt)
        weights_BNTS = None if w1_BNTS is None else w1_BNTS - lam * w2_BNTS
        return self.output(head_BTNH, x_BTD), cache, weights_BNTS
