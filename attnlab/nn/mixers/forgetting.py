"""The Forgetting Transformer (``mixer="fox"``; Lin et al. 2025, "Forgetting Transformer:
Softmax Attention with a Forget Gate"): each head has a forget gate of the layer's input,

    f_t = sigmoid(w_n . x_t + b_n),    c_t = sum_{l <= t} log f_l,
    o_i = sum_{j <= i} softmax_j(q_i . k_j * scale + c_i - c_j) v_j,

so a key's logit decays by the log forget gates between it and the query (causal). It is
``mha`` with one score function: ``ops.score_mods.forget_gate(c)``, closed over the
cumulative log gates, so every attention path (the chunked one's blocks, a fused kernel)
runs it and returns the gradient of ``c``. Parameters beside ``mha``'s: ``fgate_DN`` and
``fgate_bias_N``. Cache: ``mha``'s keys and values, and ``"log_forget"`` ``[N, S]`` float32,
each cached position's ``c``, so a decoding step extends the sum from its row's last one.

With the sequence split over the mesh's context axis (``attnlab.nn.context_parallel``) the
gates are summed in token order (``ContextMask.token_order``: the layers may run in the
zigzag layout), and every device holds the whole ``c`` ``[B, N, T]`` that the ring's score
function reads at the tokens' indices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import SLOTS, CacheEntry, MixerCall, register_mixer
from attnlab.errors import ConfigError
from attnlab.nn.context_parallel import ContextMask
from attnlab.nn.layers import normal
from attnlab.nn.mixers.mha import Attention
from attnlab.ops import score_mods
from attnlab.ops.linear import dense
from attnlab.ops.precision import wide


@register_mixer("fox")
class Forgetting(Attention):
    """Softmax attention whose logits decay by a per-head forget gate of ``x``."""

    @dataclasses.dataclass(frozen=True)
    class Settings(Attention.Settings):
        bias_init: float = 0.0  # every head's forget-gate bias at initialisation

        def validate(self, cfg) -> None:
            super().validate(cfg)
            number = isinstance(self.bias_init, int | float) and not isinstance(
                self.bias_init, bool
            )
            if not (number and math.isfinite(self.bias_init)):
                self.fail("bias_init", "a finite number (the forget gates' initial bias)")
            if not cfg.causal:
                raise ConfigError(
                    "ModelConfig.causal=False is invalid with mixer='fox': the forget gates "
                    "decay the keys before each query (causal attention); set causal=True"
                )

    context_parallel = True  # the ring and the all-gather run the gate's score function

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        settings = self.Settings() if settings is None else settings
        super().__init__(cfg, settings, rngs=rngs)
        D, N, pd = cfg.d_model, cfg.n_heads, cfg.param_dtype
        self.fgate_DN = normal(rngs, (D, N), cfg.init_std, pd)
        self.fgate_bias_N = nnx.Param(jnp.full((N,), settings.bias_init, jnp.dtype(pd)))

    @classmethod
    def cache_entries(cls, cfg, settings):
        entry = CacheEntry((cfg.n_heads, SLOTS), dtype="float32", axes=("act_heads", None))
        return {**super().cache_entries(cfg, settings), "log_forget": entry}

    def log_forget(self, x_BTD):
        """``log f_t`` per head, ``[B, T, N]``, at least float32."""
        logits_BTN = dense(x_BTD, self.fgate_DN[...], out_dtype=wide(x_BTD))
        return jax.nn.log_sigmoid(
            logits_BTN + self.fgate_bias_N[...].astype(logits_BTN.dtype)[None, None]
        )

    def cumulative(self, x_BTD, cache, mask=None):
        """``(cache, c_BNS)``: the keys' cumulative log forget gates, in token order (when
        decoding, the cache's, extended from each row's last position by this call's
        tokens); ``mask``: the call's, read for the layout of a split sequence."""
        log_f_BTN = self.log_forget(x_BTD)
        if isinstance(mask, ContextMask):  # in the layers' layout: the sum runs in token order
            log_f_BTN = mask.token_order(log_f_BTN)
        c_BTN = jnp.cumsum(log_f_BTN, axis=1)
        if cache is None:
            return None, jnp.swapaxes(c_BTN, 1, 2)
        if cache.ring is not None:
            raise ConfigError("mixer='fox' decodes with a linear cache: set no attention window")
        before_BNS = cache.read("log_forget")
        last_B = jnp.maximum(cache.start_B - 1, 0)
        prev_BN = jnp.take_along_axis(before_BNS, last_B[:, None, None], axis=2)[..., 0]
        prev_BN = jnp.where(cache.start_B[:, None] > 0, prev_BN, 0.0)
        return cache.append("log_forget", c_BTN + prev_BN[:, None])

    def __call__(self, x_BTD, call: MixerCall):
        q_BTNH = self.query(x_BTD, call)
        cache, k_BSKH, v_BSKH = self.keys_values(x_BTD, call)
        cache, c_BNS = self.cumulative(x_BTD, cache, call.mask)
        score_mod = score_mods.forget_gate(c_BNS)
        out_BTNH, weights_BNTS = self.attend(q_BTNH, k_BSKH, v_BSKH, call, score_mod=score_mod)
        return self.output(out_BTNH, x_BTD), cache, weights_BNTS
