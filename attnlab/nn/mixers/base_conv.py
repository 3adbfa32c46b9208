"""A gated short convolution, ``mixer="base_conv"``: Zoology's ``BaseConv`` (Arora et al.
2023) with a short filter, the layer its MQAR experiments put before attention::

    y = conv1d(x) * (x W + b)          depthwise causal convolution over W taps, gated

One layer of it lets the next see each token's predecessors (a key beside its value), the
shift an induction circuit otherwise has to learn in attention. It has no heads and no
positions. Parameters: ``conv_WZ`` and ``conv_bias_Z`` (``Z = D`` channels), ``proj_DZ``
and ``proj_bias_Z``.

Cache: ``"conv"`` ``[W - 1, D]`` (the last ``W - 1`` inputs) in ``state_dtype``; a decode
step is the same call with one token.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import Mixer, MixerCall, MixerSettings, register_mixer
from attnlab.nn.layers import normal
from attnlab.nn.mixers.recurrent import (
    carried_conv,
    check_causal_conv,
    conv_cache_entries,
    conv_uniform,
    token_validity,
)
from attnlab.ops.linear import dense


@register_mixer("base_conv")
class BaseConv(Mixer):
    """Gated short causal convolution (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        conv_kernel: int = 3  # taps W (Zoology's short filter has 3)
        state_dtype: str = "float32"  # the "conv" cache entry's dtype

        def validate(self, cfg) -> None:
            check_causal_conv(self, cfg, "Zoology uses 3")

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        s = settings or self.Settings()
        self.settings = s
        D, W, pd = cfg.d_model, s.conv_kernel, jnp.dtype(cfg.param_dtype)
        self.conv_WZ = nnx.Param(conv_uniform(rngs.params(), (W, D), W, pd))
        self.conv_bias_Z = nnx.Param(conv_uniform(rngs.params(), (D,), W, pd))
        self.proj_DZ = normal(rngs, (D, D), cfg.init_std, cfg.param_dtype)
        self.proj_bias_Z = nnx.Param(jnp.zeros((D,), pd))

    @classmethod
    def cache_entries(cls, cfg, settings):
        return conv_cache_entries(cfg, settings or cls.Settings())

    def __call__(self, x_BTD, call: MixerCall):
        valid_BT = token_validity(call, x_BTD.shape[1])
        w_WZ, b_Z = self.conv_WZ[...], self.conv_bias_Z[...]
        cache, conv_BTD = carried_conv(x_BTD, call, valid_BT, w_WZ, b_Z)
        bias_Z = self.proj_bias_Z[...].astype(x_BTD.dtype)
        gate_BTD = dense(x_BTD, self.proj_DZ[...]) + bias_Z[None, None, :]
        return conv_BTD.astype(x_BTD.dtype) * gate_BTD, cache, None
