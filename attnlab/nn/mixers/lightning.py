"""Lightning attention (MiniMax-01, 2025; Lightning Attention-2, Qin et al. 2024),
``mixer="lightning"``, as transformers' ``MiniMaxLightningAttention``::

    q, k, v = silu(x W_qkv)                         per head, no positions, no scaling
    S_t = exp(-slope) S_{t-1} + v_t k_t^T,  o_t = S_t q_t     a fixed decay per head
    out = (RMSNorm(o) * sigmoid(x W_gate)) W_out    the norm over all heads together

The decay rates are not learned: head ``h`` of layer ``l`` (of ``L``) decays at
``2^(-8h/N) (1 - l / (L - 1) + 1e-5)`` (``attnlab.ops.lightning.slopes``; ``decay=False``:
no decay, plain causal linear attention). Training and prefill run the blockwise form
(intra-block plus inter-block, blocks of ``block_size`` tokens), a decode step the
recurrence (``attnlab.ops.lightning``).

Parameters, laid out as transformers' so a checkpoint maps by name and shape: ``qkv_DNH``
``[D, N, 3H]`` (per head q, k, v: the transpose of ``qkv_proj.weight``, split by head),
``gate_DNH`` (``output_gate.weight``), ``norm_scale_NH`` (``norm.weight``) and ``out_NHD``
(``out_proj.weight``).

Cache: ``"state"`` ``[N, H, H]`` (the decayed sum of ``v k^T``, fixed-size) in
``state_dtype``. Tokens that are not real (padding; past a row's count in a prefill) leave
the state as it was.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.contracts.mixer import CacheEntry, Mixer, MixerCall, MixerSettings, register_mixer
from attnlab.errors import ConfigError
from attnlab.nn import probe
from attnlab.nn.layers import normal
from attnlab.nn.mixers.recurrent import FORMS, STATE_DTYPES, check_positive, token_validity
from attnlab.ops import lightning
from attnlab.ops.linear import dense
from attnlab.ops.norms import rms_norm
from attnlab.ops.precision import upcast


@register_mixer("lightning")
class Lightning(Mixer):
    """MiniMax-01's lightning attention (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        block_size: int = 256  # tokens per block of the blockwise form (a power of two)
        decay: bool = True  # the fixed per-head decay; False: plain causal linear attention
        norm_eps: float = 1e-6  # the output RMSNorm's eps (transformers' default)
        state_dtype: str = "float32"  # the "state" cache entry's dtype: float32 or bfloat16
        form: str = "chunked"  # training and prefill: "chunked" (blockwise) or "recurrent"

        def validate(self, cfg) -> None:
            if cfg.arch != "decoder":
                raise ConfigError(
                    f"ModelConfig.arch={cfg.arch!r} is invalid with mixer={cfg.mixer!r}: the "
                    "layer is causal and decodes from its carried state; use arch='decoder'"
                )
            check_positive(self, "block_size", allow_none=False)
            if self.block_size & (self.block_size - 1):
                self.fail("block_size", "a power of two (MiniMax-01 uses 256)")
            if not isinstance(self.decay, bool):
                self.fail("decay", "True or False")
            eps = self.norm_eps
            if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
                self.fail("norm_eps", "a positive float (1e-6 by default)")
            if self.state_dtype not in STATE_DTYPES:
                self.fail("state_dtype", f"one of {STATE_DTYPES}")
            if self.form not in FORMS:
                self.fail("form", f"one of {FORMS}")

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        s = settings or self.Settings()
        self.settings, self.n_layers = s, cfg.n_layers
        D, N, H, pd, std = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.param_dtype, cfg.init_std
        self.qkv_DNH = normal(rngs, (D, N, 3 * H), std, pd)
        self.gate_DNH = normal(rngs, (D, N, H), std, pd)
        self.norm_scale_NH = nnx.Param(jnp.ones((N, H), jnp.dtype(pd)))
        self.out_NHD = normal(rngs, (N, H, D), std / (2 * cfg.n_layers) ** 0.5, pd)

    @classmethod
    def inherit(cls, cfg, settings, old, new):
        """From softmax attention's projections (``q_DNH``, ``k_DKH``, ``v_DKH``, ``o_NHD``)
        of the same heads and width: each head's q, its key-value head's k and v, and the
        output projection. The gate and the norm stay fresh."""
        if not {"q_DNH", "k_DKH", "v_DKH", "o_NHD"} <= set(old):
            return {}
        q_DNH, k_DKH, v_DKH, o_NHD = (
            np.asarray(old[k]) for k in ("q_DNH", "k_DKH", "v_DKH", "o_NHD")
        )
        if q_DNH.shape[1:] != (cfg.n_heads, cfg.head_dim):
            return {}
        G = q_DNH.shape[1] // k_DKH.shape[1]
        kv = lambda w: np.repeat(w, G, axis=1)  # query head n: its key-value head's
        qkv_DNH = np.concatenate([q_DNH, kv(k_DKH), kv(v_DKH)], axis=-1)
        return {"qkv_DNH": qkv_DNH, "out_NHD": o_NHD}

    @classmethod
    def cache_entries(cls, cfg, settings):
        s = settings or cls.Settings()
        N, H = cfg.n_heads, cfg.head_dim
        return {"state": CacheEntry((N, H, H), s.state_dtype, ("act_heads", None, None))}

    def slopes(self, call: MixerCall, dtype=jnp.float32):
        """``[N]`` decay rates of the call's layer in ``dtype`` (0 without decay)."""
        N = self.norm_scale_NH.shape[0]
        if not self.settings.decay:
            return jnp.zeros((N,), dtype)
        layer = 0 if call.layer is None else call.layer
        return lightning.slopes(N, layer, self.n_layers, dtype)

    def __call__(self, x_BTD, call: MixerCall):
        s = self.settings
        B, T, _ = x_BTD.shape
        N, H = self.norm_scale_NH.shape
        valid_BT = token_validity(call, T)
        cache = call.cache
        qkv_BTNH = jax.nn.silu(upcast(dense(x_BTD, self.qkv_DNH[...])))
        q_BTNH, k_BTNH, v_BTNH = jnp.split(qkv_BTNH, 3, axis=-1)
        slope_N = self.slopes(call, qkv_BTNH.dtype)
        state = None if cache is None else upcast(cache.read("state"))
        if cache is not None and T == 1:  # a decode step
            valid_B = None if valid_BT is None else valid_BT[:, 0]
            o_BNH, state = lightning.lightning_step(
                q_BTNH[:, 0], k_BTNH[:, 0], v_BTNH[:, 0], slope_N, state, valid_B
            )
            o_BTNH = o_BNH[:, None]
        elif s.form == "recurrent":
            o_BTNH, state = lightning.lightning_recurrent(
                q_BTNH, k_BTNH, v_BTNH, slope_N, state, valid_BT
            )
        else:
            o_BTNH, state = lightning.lightning_blocks(
                q_BTNH, k_BTNH, v_BTNH, slope_N, state, valid_BT, block_size=s.block_size
            )
        probe.record("state", state)  # the final recurrent state, read-only
        if cache is not None:
            cache = cache.put("state", state)
        scale = self.norm_scale_NH[...].reshape(N * H)
        o_BTZ = rms_norm(o_BTNH.reshape(B, T, N * H), scale, eps=s.norm_eps)
        gate_BTNH = jax.nn.sigmoid(upcast(dense(x_BTD, self.gate_DNH[...])))
        o_BTNH = o_BTZ.reshape(B, T, N, H) * gate_BTNH
        return dense(o_BTNH.astype(x_BTD.dtype), self.out_NHD[...], n_in=2), cache, None
