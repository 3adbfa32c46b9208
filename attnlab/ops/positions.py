"""Position encodings as pure functions of explicit positions.

* ``sinusoidal``: the 2017 table, PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(...).
  ``layout="split"`` puts all sines first then all cosines (Marian, fairseq).
* RoPE: ``apply_rope(x_BTNH, positions_BT)`` rotates pairs (i, i + H/2): the half-split
  layout used by Llama, Mistral and Qwen.
* ALiBi: ``alibi_slopes(N)`` and ``alibi_bias`` (``-slope * |q_pos - k_pos|``).
* T5 relative position bias: ``relative_position_bucket`` and ``relative_position_bias``.
* ``PositionBias``: ALiBi, T5 or any bias of the same form as a *description* (the
  function, its parameters and the positions) that attention evaluates block by block, so
  that blockwise attention never builds ``[B, N, T, S]``.

Learned absolute positions are parameters, so they live in ``attnlab.nn``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def sinusoidal(num_positions, d, *, base=10000.0, layout="interleaved", dtype=jnp.float32):
    """[num_positions, d] sinusoidal table (computed in float64 with NumPy, then cast)."""
    if d % 2:
        raise ValueError(f"sinusoidal positions need an even width, got d={d}")
    if layout not in ("interleaved", "split"):
        raise ValueError(f"layout={layout!r}: use 'interleaved' (2017) or 'split' (sin | cos)")
    pos = np.arange(num_positions, dtype=np.float64)[:, None]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)[None, :]
    angles = pos * inv
    table = np.empty((num_positions, d), np.float64)
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    else:
        table[:, : d // 2], table[:, d // 2 :] = np.sin(angles), np.cos(angles)
    return jnp.asarray(table, dtype)


def rope_inv_frequencies(head_dim, theta=10000.0):
    """[H/2] inverse frequencies theta^(-2i/H)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x_BTNH, positions_BT, *, theta=10000.0, rotary_dim=None):
    """Rotates ``x`` by its positions (half-split layout); computed in float32.

    ``rotary_dim`` (partial rotary, Phi-3): only the first ``rotary_dim`` head dims rotate,
    as a head of that size; the rest pass through."""
    if rotary_dim is not None and rotary_dim < x_BTNH.shape[-1]:
        rotated = apply_rope(x_BTNH[..., :rotary_dim], positions_BT, theta=theta)
        return jnp.concatenate([rotated, x_BTNH[..., rotary_dim:]], -1)
    H = x_BTNH.shape[-1]
    inv_h = rope_inv_frequencies(H, theta)
    angles_BTh = jnp.asarray(positions_BT, jnp.float32)[..., None] * inv_h[None, None, :]
    sin_BT1h = jnp.sin(angles_BTh)[:, :, None, :]
    cos_BT1h = jnp.cos(angles_BTh)[:, :, None, :]
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    out = jnp.concatenate([x1 * cos_BT1h - x2 * sin_BT1h, x2 * cos_BT1h + x1 * sin_BT1h], -1)
    return out.astype(x_BTNH.dtype)


def alibi_slopes(num_heads):
    """[N] ALiBi head slopes (geometric; the paper's interpolation when N is not 2^k)."""

    def power_of_two(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(slopes, jnp.float32)


def alibi_bias(slopes_N, q_positions_BT, k_positions_BS):
    """[B, N, T, S] ALiBi bias ``-slope * |q_pos - k_pos|``."""
    q = jnp.asarray(q_positions_BT)[:, None, :, None]
    k = jnp.asarray(k_positions_BS)[:, None, None, :]
    return -slopes_N[None, :, None, None] * jnp.abs(q - k).astype(jnp.float32)


def relative_position_bucket(
    relative_position, *, bidirectional=True, num_buckets=32, max_distance=128
):
    """T5's bucketing of ``k_pos - q_pos``: exact for small distances, log-spaced beyond."""
    rel = jnp.asarray(relative_position)
    bucket = jnp.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (rel > 0).astype(rel.dtype) * num_buckets
        rel = jnp.abs(rel)
    else:
        rel = -jnp.minimum(rel, 0)
    max_exact = num_buckets // 2
    is_small = rel < max_exact
    rel_f = jnp.maximum(rel, 1).astype(jnp.float32)
    large = max_exact + (
        jnp.log(rel_f / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(rel.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(is_small, rel, large)


def relative_position_bias(
    table_XN, q_positions_BT, k_positions_BS, *, bidirectional=True, max_distance=128
):
    """[B, N, T, S] bias gathered from a learned ``[num_buckets, N]`` table."""
    rel_BTS = jnp.asarray(k_positions_BS)[:, None, :] - jnp.asarray(q_positions_BT)[:, :, None]
    buckets_BTS = relative_position_bucket(
        rel_BTS,
        bidirectional=bidirectional,
        num_buckets=table_XN.shape[0],
        max_distance=max_distance,
    )
    return jnp.transpose(table_XN[buckets_BTS], (0, 3, 1, 2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PositionBias:
    """An additive logit bias ``fn(params, q_pos_BT, k_pos_BS, **options)`` ->
    ``[B|1, N|1, T, S]``, kept as a description so it can be evaluated per block.

    ``params`` is the pytree of arrays the bias reads (ALiBi slopes, a learned relative
    table); it is an explicit input rather than something ``fn`` closes over, so blockwise
    attention can return its gradient from a custom backward pass. ``fn`` and ``options``
    are static (hashable): pass a module-level function, not a fresh lambda, so that jitted
    functions taking a ``PositionBias`` do not retrace. ``dense()`` is the whole bias.
    """

    params: Any
    q_pos: Any  # [B|1, T] int32
    k_pos: Any  # [B|1, S] int32
    fn: Callable = dataclasses.field(default=None, metadata=dict(static=True))
    options: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @classmethod
    def alibi(cls, slopes_N, q_positions_BT, k_positions_BS):
        """ALiBi over these positions, as ``alibi_bias``."""
        return cls(slopes_N, q_positions_BT, k_positions_BS, fn=alibi_bias)

    @classmethod
    def relative(
        cls, table_XN, q_positions_BT, k_positions_BS, *, bidirectional=True, max_distance=128
    ):
        """T5 relative buckets over these positions, as ``relative_position_bias``."""
        options = (("bidirectional", bidirectional), ("max_distance", max_distance))
        return cls(
            table_XN, q_positions_BT, k_positions_BS, fn=relative_position_bias, options=options
        )

    def __call__(self, q_pos_BT, k_pos_BS, params=None):
        """The bias between the given positions (with other ``params`` when given)."""
        params = self.params if params is None else params
        return self.fn(params, q_pos_BT, k_pos_BS, **dict(self.options))

    def dense(self):
        """The whole ``[B|1, N, T, S]`` bias."""
        return self(self.q_pos, self.k_pos)

    def block(self, q_start, size_q, k_start, size_k, params=None):
        """The ``[B|1, N|1, size_q, size_k]`` block at (``q_start``, ``k_start``)."""
        q_pos = jax.lax.dynamic_slice_in_dim(self.q_pos, q_start, size_q, 1)
        k_pos = jax.lax.dynamic_slice_in_dim(self.k_pos, k_start, size_k, 1)
        return self(q_pos, k_pos, params)

    def replace(self, **changes):
        """A copy with ``changes`` to the fields."""
        return dataclasses.replace(self, **changes)
