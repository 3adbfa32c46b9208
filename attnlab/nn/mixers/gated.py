"""Gated attention (``mixer="gated"``; Qwen3-Next, "Gated Attention for Large Language
Models", Qiu et al. 2025): a sigmoid gate computed from the layer's input ``x`` scales each
head's attention output before the output projection (the paper's G1 position),

    y_n = attention_n(x) * sigmoid(x W_gate)_n,    out = sum_n y_n W_o,n.

``kind="headwise"`` gives one gate per head (``gate_DN``), ``"elementwise"`` one per output
element (``gate_DNH``). Keys, values and the cache are ``mha``'s.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from attnlab.contracts.mixer import register_mixer
from attnlab.nn.layers import normal
from attnlab.nn.mixers.mha import Attention
from attnlab.ops.linear import dense
from attnlab.ops.precision import wide

KINDS = ("headwise", "elementwise")


@register_mixer("gated")
class Gated(Attention):
    """Softmax attention whose head outputs pass a sigmoid gate of ``x``."""

    @dataclasses.dataclass(frozen=True)
    class Settings(Attention.Settings):
        kind: str = "headwise"  # one gate per head, or "elementwise": one per output element

        def validate(self, cfg) -> None:
            super().validate(cfg)
            if self.kind not in KINDS:
                self.fail("kind", f"use one of {KINDS}")

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        settings = self.Settings() if settings is None else settings
        super().__init__(cfg, settings, rngs=rngs)
        D, N, H = cfg.d_model, cfg.n_heads, cfg.head_dim
        shape = (D, N) if settings.kind == "headwise" else (D, N, H)
        gate = normal(rngs, shape, cfg.init_std, cfg.param_dtype)
        self.gate_DN = gate if settings.kind == "headwise" else None
        self.gate_DNH = gate if settings.kind == "elementwise" else None

    def output(self, out_BTNH, x_BTD=None):
        if self.gate_DN is not None:
            gate_BTNH = dense(x_BTD, self.gate_DN[...], out_dtype=wide(x_BTD))[..., None]
        else:
            gate_BTNH = dense(x_BTD, self.gate_DNH[...], out_dtype=wide(x_BTD))
        gated_BTNH = out_BTNH * jax.nn.sigmoid(gate_BTNH).astype(out_BTNH.dtype)
        return super().output(gated_BTNH, x_BTD)
