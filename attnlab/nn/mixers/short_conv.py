"""A doubly gated short convolution in LFM2's form, ``mixer="short_conv"`` (Liquid AI's
LFM2 "short convolution" operator)::

    b, c, h = x W_b, x W_c, x W_h                 three projections of the input (one in_proj)
    y = (c * conv1d(b * h)) W_out                 depthwise causal convolution over W taps

The input gate ``b`` multiplies the convolution's input, the output gate ``c`` its output.
It has no heads and no positions. Parameters: ``b_proj_DZ``, ``c_proj_DZ``, ``h_proj_DZ``
(``Z = D`` channels), ``conv_WZ`` and ``out_ZD``; with ``bias``, ``b_bias_Z``,
``c_bias_Z``, ``h_bias_Z``, ``conv_bias_Z`` and ``out_bias_D``.

Cache: ``"conv"`` ``[W - 1, D]`` (the last ``W - 1`` gated inputs ``b * h``) in
``state_dtype``; a decode step is the same call with one token. Tokens that are not real
(padding) put nothing into the convolution.
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
from attnlab.ops.linear import add_bias, dense


@register_mixer("short_conv")
class ShortConv(Mixer):
    """LFM2's gated short causal convolution (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        conv_kernel: int = 3  # taps W (LFM2's conv_L_cache)
        bias: bool = False  # biases on the projections and the convolution (LFM2's conv_bias)
        state_dtype: str = "float32"  # the "conv" cache entry's dtype

        def validate(self, cfg) -> None:
            check_causal_conv(self, cfg, "LFM2 uses 3")
            if not isinstance(self.bias, bool):
                self.fail("bias", "True or False")

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        s = settings or self.Settings()
        self.settings = s
        D, W, pd = cfg.d_model, s.conv_kernel, jnp.dtype(cfg.param_dtype)
        self.conv_WZ = nnx.Param(conv_uniform(rngs.params(), (W, D), W, pd))
        self.b_proj_DZ = normal(rngs, (D, D), cfg.init_std, cfg.param_dtype)
        self.c_proj_DZ = normal(rngs, (D, D), cfg.init_std, cfg.param_dtype)
        self.h_proj_DZ = normal(rngs, (D, D), cfg.init_std, cfg.param_dtype)
        self.out_ZD = normal(rngs, (D, D), cfg.init_std, cfg.param_dtype)
        zeros = lambda: nnx.Param(jnp.zeros((D,), pd)) if s.bias else None
        self.b_bias_Z, self.c_bias_Z, self.h_bias_Z = zeros(), zeros(), zeros()
        self.conv_bias_Z, self.out_bias_D = zeros(), zeros()

    @classmethod
    def cache_entries(cls, cfg, settings):
        return conv_cache_entries(cfg, settings or cls.Settings())

    def _project(self, x_BTD, w, b):
        y_BTZ = dense(x_BTD, w[...])
        return y_BTZ if b is None else add_bias(y_BTZ, b[...])

    def __call__(self, x_BTD, call: MixerCall):
        valid_BT = token_validity(call, x_BTD.shape[1])
        b_BTZ = self._project(x_BTD, self.b_proj_DZ, self.b_bias_Z)
        c_BTZ = self._project(x_BTD, self.c_proj_DZ, self.c_bias_Z)
        h_BTZ = self._project(x_BTD, self.h_proj_DZ, self.h_bias_Z)
        bias_Z = None if self.conv_bias_Z is None else self.conv_bias_Z[...]
        cache, conv_BTZ = carried_conv(b_BTZ * h_BTZ, call, valid_BT, self.conv_WZ[...], bias_Z)
        y_BTZ = c_BTZ * conv_BTZ.astype(x_BTD.dtype)
        return self._project(y_BTZ, self.out_ZD, self.out_bias_D), cache, None
