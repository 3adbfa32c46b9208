"""The blocks of the chunked path (``attnlab.ops.chunked``): what the custom VJP holds
static, a block's slice of a mask or bias, its logits and score function, and the loops
over the blocks a row visits (``attnlab.ops.block_mask`` says which (query block, key
block) pairs a loop visits and which of them need their mask). The forward pass
(``chunked``) and the backward pass (``chunked_backward``) both build on these."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attnlab.ops import score_mods
from attnlab.ops.block_mask import FULL, PARTIAL
from attnlab.ops.masks import MaskSpec
from attnlab.ops.positions import PositionBias
from attnlab.ops.precision import wide


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


def scores(st: Static, q_blk, k_blk, bias, i, j):
    """Block (i, j) logits in at least float32, scaled, biased and capped (before the score
    function and the mask), and the cap's derivative ``1 - tanh^2(s / c)`` (None without a cap)."""
    _, K, G, _, _ = q_blk.shape
    cdt = wide(q_blk, k_blk)  # float32, or float64 for a float64 model
    s = jnp.einsum("BKGtH,BKsH->BKGts", q_blk, k_blk, preferred_element_type=cdt)
    s = s * st.scale
    b = bias_block(bias, i, j, st, K, G)
    if b is not None:
        s = s + b
    dcap = None
    if st.softcap is not None:
        tanh = jnp.tanh(s / st.softcap)
        s, dcap = st.softcap * tanh, 1.0 - tanh * tanh
    return s, dcap


def mod_fn(st: Static, shape, q_off, i, j):
    """Block (i, j)'s score function of ``(s, consts)``: ``st.score_mod`` with the block's
    batch, head, query and key indices (padded queries and keys take the last real index,
    so a function indexing a table by them stays in bounds; their entries are masked)."""
    B, K, G, tq, tk = shape
    i32 = jnp.int32
    q_idx = q_off[:, None] + jnp.minimum(i * tq + jnp.arange(tq, dtype=i32), st.T - 1)[None]
    kv_idx = jnp.minimum(j * tk + jnp.arange(tk, dtype=i32), st.S - 1)
    args = score_mods.indices(B, K, G, q_idx, kv_idx)
    return lambda s, consts: st.score_mod(s, *args, *consts).astype(s.dtype)


def visit_order(kind):
    """Per row of a ``[rows, cols]`` table of kinds: the ``FULL`` columns first, then the
    ``PARTIAL`` ones (each ascending), and the two counts, so one loop runs the full blocks
    without evaluating the mask and a second the partial ones with it (the online softmax
    and the gradient sums do not depend on the order); ``EMPTY`` columns are never visited."""
    order = jnp.argsort(-kind.astype(jnp.int32), axis=1, stable=True).astype(jnp.int32)
    n_full = (kind == FULL).sum(1).astype(jnp.int32)
    return order, n_full, n_full + (kind == PARTIAL).sum(1).astype(jnp.int32)


def loops(st: Static, body, n_full, n_any, carry):
    """``body(c, carry, masked)`` over ``c`` in ``[0, n_full)`` unmasked, then
    ``[n_full, n_any)`` masked (one unmasked loop to ``n_any`` when every block is full)."""
    if st.all_full:
        return jax.lax.fori_loop(0, n_any, lambda c, x: body(c, x, False), carry)
    carry = jax.lax.fori_loop(0, n_full, lambda c, x: body(c, x, False), carry)
    return jax.lax.fori_loop(n_full, n_any, lambda c, x: body(c, x, True), carry)
