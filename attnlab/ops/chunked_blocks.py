"""The blocks of the chunked path (``attnlab.ops.chunked``): what the custom VJP holds
static, a block's slice of a mask or bias, and which (query block, key block) pairs hold
an allowed entry and in which order a loop visits them."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from attnlab.ops.masks import MaskSpec
from attnlab.ops.positions import PositionBias


class Static(NamedTuple):
    """What the custom VJP treats as static: the logit scale, the cap and the blocking."""

    scale: float
    softcap: float | None
    block_q: int
    block_k: int
    S: int  # keys before padding: keys at index >= S are masked


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


def block_grid(mask, st: Static, nq, nk):
    """[nq, nk] bool: the (query block, key block) pairs that may hold an allowed entry."""
    if isinstance(mask, MaskSpec):
        return mask.block_any(st.block_q, st.block_k)
    if mask is None:
        return jnp.ones((nq, nk), bool)
    Bm, Km, Gm, Tm, Sm = mask.shape
    # [.., T|1, S|1] -> [.., nq|1, tq|1, nk|1, tk|1], then any() over all but the block axes.
    rows = (nq, st.block_q) if Tm != 1 else (1, 1)
    cols = (nk, st.block_k) if Sm != 1 else (1, 1)
    per_block = mask.reshape(Bm * Km * Gm, *rows, *cols).any(axis=(0, 2, 4))
    return jnp.broadcast_to(per_block, (nq, nk))


def visit_order(grid):
    """For each row of ``grid``: the indices of its True entries first (in order), and
    their count. A loop over ``order[r, :count[r]]`` visits exactly the needed blocks."""
    order = jnp.argsort(~grid, axis=1, stable=True).astype(jnp.int32)
    return order, grid.sum(1).astype(jnp.int32)
