"""``ffn_variant="none"``: layers without a feed-forward sub-layer, as Mamba-2's blocks are
(norm -> mixer -> residual, no MLP).

The block (``attnlab.nn.blocks``) still runs its FFN sub-layer; this variant owns no
parameters and returns zeros, so in pre-norm placement the sub-layer adds nothing and the
layer is its mixer alone. The block's FFN input norm (``ffn_norm``) stays a parameter that no
computation reads (its gradient is zero); a checkpoint loader fills it with ones.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from attnlab.contracts.ffn import FFN, FFNSettings, register_ffn
from attnlab.errors import ConfigError


@register_ffn("none")
class NoFFN(FFN):
    """No feed-forward network: the sub-layer's output is zero (see the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(FFNSettings):
        def validate(self, cfg) -> None:
            if cfg.norm_placement != "pre":
                raise ConfigError(
                    f"ModelConfig.norm_placement={cfg.norm_placement!r} is invalid with "
                    "ffn_variant='none': only 'pre' leaves a layer without its FFN unchanged "
                    "by the FFN's norm; use norm_placement='pre'"
                )

    def __init__(self, cfg, settings=None, *, rngs=None):
        pass

    def __call__(self, x_BTD, *, key=None):
        return jnp.zeros_like(x_BTD)
