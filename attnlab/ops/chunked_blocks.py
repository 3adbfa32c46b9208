"""The blocks of the chunked path (``attnlab.ops.chunked``): what the custom VJP holds
static and a block's slice of a mask or bias (``attnlab.ops.block_mask`` says which
(query block, key block) pairs a loop visits and which of them need their mask)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attnlab.ops.masks import MaskSpec
from attnlab.ops.positions import PositionBias


class Static(NamedTuple):
    """What the custom VJP treats as static: the logit scale, the cap, the blocking and the
    score function (closure-converted: ``score_mod(s, b, h, q_idx, kv_idx, *consts)``)."""

    scale: float
    softcap: float | None
    block_q: int
    block_k: int
    S: int  # keys before padding: keys at index >= S are masked
    T: int = 0  # queries before padding
    score_mod: Callable | None = None
    # Whether every visited block is FULL (no mask, no padded keys): no mask, no branch.
    all_full: bool = False


def to_BKG(x, K, G):
    """[B|1, N|1, ...] -> [B|1, K|1, G|1, ...] (a bias's or a mask's head axis grouped)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], K, G, *x.shape[2:])


def pad_axis(x, axis, size, value=0):
    if x.shape[axis] in (1, size):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def slice_TS(x, i, j, st: Static):
    """Block (i, j) of a [B|1, K|1, G|1, T|1, S|1] array (axes of size 1 are kept)."""
    if x.shape[3] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, i * st.block_q, st.block_q, 3)
    if x.shape[4] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, j * st.block_k, st.block_k, 4)
    return x


def mask_block(mask, i, j, st: Static, S_pad):
    """[B|1, K|1, G|1, tq, tk] bool of block (i, j), or None when nothing is masked."""
    tq, tk = st.block_q, st.block_k
    if isinstance(mask, MaskSpec):
        out = mask.block(i * tq, tq, j * tk, tk)[:, :, None]  # [B|1, 1, 1, tq, tk]
    elif mask is not None:
        out = slice_TS(mask, i, j, st)
    else:
        out = None
    if S_pad != st.S:  # padded keys
        real_k = ((j * tk + jnp.arange(tk)) < st.S)[None, None, None, None, :]
        out = real_k if out is None else out & real_k
    return out


def bias_block(bias, i, j, st: Static, K, G, params=None):
    """[B|1, K|1, G|1, tq|1, tk|1] float32 bias of block (i, j), or None."""
    if bias is None:
        return None
    if isinstance(bias, PositionBias):
        b = bias.block(i * st.block_q, st.block_q, j * st.block_k, st.block_k, params)
        return to_BKG(b, K, G).astype(jnp.float32)
    return slice_TS(bias, i, j, st).astype(jnp.float32)
