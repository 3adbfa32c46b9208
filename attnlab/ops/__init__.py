"""Pure JAX functions for attention: no Flax, no state. See ``attnlab.dims`` for names."""

from attnlab.ops import activations, linear, masks, norms, positions
from attnlab.ops.activations import (
    FFN_KINDS,
    feed_forward,
    geglu,
    geglu_tanh,
    gelu,
    gelu_tanh,
    relu,
    silu,
    swiglu,
)
from attnlab.ops.attention import IMPLEMENTATIONS, dot_product_attention, reference_attention
from attnlab.ops.linear import add_bias, dense, dropout, fold
from attnlab.ops.masks import (
    causal,
    combine,
    cross,
    lengths_to_valid,
    padding,
    padding_from_lengths,
    prefix_lm,
    segment,
    sliding_window,
)
from attnlab.ops.norms import layer_norm, rms_norm
from attnlab.ops.positions import (
    alibi_bias,
    alibi_slopes,
    apply_rope,
    relative_position_bias,
    relative_position_bucket,
    rope_inv_frequencies,
    sinusoidal,
)

__all__ = [
    "FFN_KINDS",
    "IMPLEMENTATIONS",
    "activations",
    "add_bias",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "causal",
    "combine",
    "cross",
    "dense",
    "dropout",
    "dot_product_attention",
    "feed_forward",
    "fold",
    "geglu",
    "geglu_tanh",
    "gelu",
    "gelu_tanh",
    "layer_norm",
    "lengths_to_valid",
    "linear",
    "masks",
    "norms",
    "padding",
    "padding_from_lengths",
    "positions",
    "prefix_lm",
    "reference_attention",
    "relative_position_bias",
    "relative_position_bucket",
    "relu",
    "rms_norm",
    "rope_inv_frequencies",
    "segment",
    "silu",
    "sinusoidal",
    "sliding_window",
    "swiglu",
]
