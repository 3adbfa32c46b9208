"""Attention sinks (``mixer="sinks"``; gpt-oss, "Efficient Streaming Language Models with
Attention Sinks", Xiao et al. 2023): each head has a learned logit ``sinks_N`` that joins
the softmax's denominator and takes weight without a value,

    out_t = sum_s exp(s_ts) v_s / (sum_s' exp(s_ts') + exp(sink_n)),

so a head may attend to nothing. Everything else, the cache included, is ``mha``'s; the maths
is ``ops.dot_product_attention(..., sinks=...)``, blockwise on the chunked path.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import MixerCall, register_mixer
from attnlab.nn.mixers.mha import Attention


@register_mixer("sinks")
class Sinks(Attention):
    """Softmax attention with one learned sink logit per query head."""

    @dataclasses.dataclass(frozen=True)
    class Settings(Attention.Settings):
        init: float = 0.0  # every head's sink logit at initialisation

        def validate(self, cfg) -> None:
            super().validate(cfg)
            number = isinstance(self.init, int | float) and not isinstance(self.init, bool)
            if not (number and math.isfinite(self.init)):
                self.fail("init", "a finite number (the sinks' initial logit)")

    # The ring and all-gather paths of a split sequence have no sinks: attention stays whole.
    context_parallel = False

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        settings = self.Settings() if settings is None else settings
        super().__init__(cfg, settings, rngs=rngs)
        self.sinks_N = nnx.Param(
            jnp.full((cfg.n_heads,), settings.init, jnp.dtype(cfg.param_dtype))
        )

    def statistics(self, q_BTNH, k_BSKH, call: MixerCall, **extra):
        return super().statistics(q_BTNH, k_BSKH, call, sinks_N=self.sinks_N[...], **extra)

    def attend(self, q_BTNH, k_BSKH, v_BSKH, call: MixerCall, **extra):
        return super().attend(q_BTNH, k_BSKH, v_BSKH, call, sinks=self.sinks_N[...], **extra)
