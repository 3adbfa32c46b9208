"""The backward pass of chunked attention (``attnlab.ops.chunked``, whose docstring gives
the recurrence): per key block, over its non-empty query blocks, each block's weights are
recomputed from the saved log-sum-exp and ``dQ``, ``dK``, ``dV``, the bias's gradient
(dense, or a ``PositionBias``'s parameters) and the score function's float arrays'
gradients are summed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.ops import score_mods
from attnlab.ops.chunked_blocks import (
    Static,
    loops,
    mask_block,
    mod_fn,
    scores,
    to_BKG,
    visit_order,
)
from attnlab.ops.positions import PositionBias
from attnlab.ops.precision import wide


def _zero_cotangent(x):
    """Zero cotangents for a pytree of non-differentiable inputs (masks, positions)."""

    def zero(leaf):
        leaf = jnp.asarray(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jnp.zeros_like(leaf)
        return np.zeros(leaf.shape, jax.dtypes.float0)

    return jax.tree.map(zero, x)


def _reduce_to(x, shape):
    """``x`` summed over the axes where ``shape`` has 1 (the broadcast axes), keepdims."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 != n)
    return x.sum(axes, keepdims=True) if axes else x


def backward(st: Static, res, cotangents):
    """The custom VJP's backward pass (``attnlab.ops.chunked``'s module docstring): the
    cotangents of ``_attention``'s inputs from its residuals ``res`` and the cotangents
    of ``(out, lse)``."""
    q, k, v, mask, bias, bm, q_off, consts, out, lse = res
    dout, dlse = cotangents
    B, K, G, T_pad, H = q.shape
    cdt = wide(q, k)  # float32, or float64 for a float64 model
    S_pad = k.shape[2]
    tq, tk = st.block_q, st.block_k
    nk = S_pad // tk
    # D - d lse: the per-row term of dS (``d lse`` is zero on fully masked rows, lse = inf).
    d_BKGT = jnp.sum(dout.astype(cdt) * out.astype(cdt), -1) - dlse
    dense_bias = bias is not None and not isinstance(bias, PositionBias)
    fn_bias = isinstance(bias, PositionBias)
    if dense_bias:
        dbias0 = jnp.zeros(bias.shape, cdt)
    elif fn_bias:
        dbias0 = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), cdt), bias.params)
    else:
        dbias0 = None
    # Only the float arrays the score function closes over take a gradient; the others
    # (integer offsets, boolean flags, positions) stay closed over in the pullback.
    wants = score_mods.differentiable(consts)
    dconsts0 = tuple(jnp.zeros(c.shape, cdt) for c in score_mods.floats(consts, wants))
    order, n_full, n_any = visit_order(bm.kind_QK.T)  # query blocks per key block

    def key_block(carry, j):
        dq, dbias, dconsts = carry
        k_blk = jax.lax.dynamic_slice_in_dim(k, j * tk, tk, 2)
        v_blk = jax.lax.dynamic_slice_in_dim(v, j * tk, tk, 2)

        def query_block(c, inner, masked):
            i = order[j, c]
            q_blk = jax.lax.dynamic_slice_in_dim(q, i * tq, tq, 3)
            do_blk = jax.lax.dynamic_slice_in_dim(dout, i * tq, tq, 3)
            lse_blk = jax.lax.dynamic_slice_in_dim(lse, i * tq, tq, 3)
            d_blk = jax.lax.dynamic_slice_in_dim(d_BKGT, i * tq, tq, 3)

            dk, dv, dq, dbias, dconsts = inner
            s, dcap = scores(st, q_blk, k_blk, bias, i, j)
            if st.score_mod is not None:
                mod = mod_fn(st, s.shape, q_off, i, j)
                with_floats = lambda s, f: mod(s, score_mods.merge(consts, f, wants))
                s, mod_vjp = jax.vjp(with_floats, s, score_mods.floats(consts, wants))
            allowed = mask_block(mask, i, j, st, S_pad) if masked else None
            p = jnp.exp(s - lse_blk[..., None])  # zero on fully masked rows (lse = inf)
            if allowed is not None:
                p = jnp.where(allowed, p, 0.0)
            dv = dv + jnp.einsum(
                "BKGts,BKGtH->BKsH",
                p.astype(dout.dtype),
                do_blk,
                preferred_element_type=cdt,
            )
            dp = jnp.einsum("BKGtH,BKsH->BKGts", do_blk, v_blk, preferred_element_type=cdt)
            ds = p * (dp - d_blk[..., None])  # d logits (after the score function)
            if st.score_mod is not None:
                ds, dc = mod_vjp(ds)
                dconsts = tuple(a + g.astype(cdt) for a, g in zip(dconsts, dc, strict=True))
            if dcap is not None:
                ds = ds * dcap
            dq_blk = jnp.einsum(
                "BKGts,BKsH->BKGtH",
                ds.astype(k.dtype),
                k_blk,
                preferred_element_type=cdt,
            )
            start = i * tq
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq,
                jax.lax.dynamic_slice_in_dim(dq, start, tq, 3) + st.scale * dq_blk,
                start,
                3,
            )
            dk = dk + st.scale * jnp.einsum(
                "BKGts,BKGtH->BKsH",
                ds.astype(q.dtype),
                q_blk,
                preferred_element_type=cdt,
            )
            if dense_bias:
                at = (
                    0,
                    0,
                    0,
                    start if bias.shape[3] != 1 else 0,
                    j * tk if bias.shape[4] != 1 else 0,
                )
                block = _reduce_to(ds, bias.shape)
                dbias = jax.lax.dynamic_update_slice(
                    dbias, jax.lax.dynamic_slice(dbias, at, block.shape) + block, at
                )
            elif fn_bias:
                dbias = jax.tree.map(jnp.add, dbias, _bias_param_grad(bias, ds, i, j, st, K, G))
            return dk, dv, dq, dbias, dconsts

        zeros = jnp.zeros((B, K, tk, H), cdt)
        dk, dv, dq, dbias, dconsts = loops(
            st, query_block, n_full[j], n_any[j], (zeros, zeros, dq, dbias, dconsts)
        )
        return (dq, dbias, dconsts), (dk, dv)

    dq0 = jnp.zeros(q.shape, cdt)
    (dq, dbias, dconsts), (dk, dv) = jax.lax.scan(
        key_block, (dq0, dbias0, dconsts0), jnp.arange(nk, dtype=jnp.int32)
    )
    head_major = lambda x: jnp.moveaxis(x, 0, 2).reshape(B, K, S_pad, H)
    dk, dv = head_major(dk).astype(k.dtype), head_major(dv).astype(v.dtype)
    if dense_bias:
        dbias = dbias.astype(bias.dtype)
    elif fn_bias:
        dparams = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), dbias, bias.params)
        dbias = _zero_cotangent(bias).replace(params=dparams)
    grads = iter(dconsts)
    dconsts = tuple(
        next(grads).astype(jnp.result_type(c)) if w else score_mods.no_gradient(c)
        for c, w in zip(consts, wants, strict=True)
    )
    zero = _zero_cotangent
    return dq.astype(q.dtype), dk, dv, zero(mask), dbias, zero(bm), zero(q_off), dconsts


def _bias_param_grad(bias: PositionBias, ds, i, j, st: Static, K, G):
    """Cotangent of ``bias.params`` from block (i, j)'s logit cotangent ``ds``."""
    block, vjp = jax.vjp(
        lambda p: bias.block(i * st.block_q, st.block_q, j * st.block_k, st.block_k, p),
        bias.params,
    )
    ct = _reduce_to(ds, to_BKG(block, K, G).shape).reshape(block.shape)
    (grad,) = vjp(ct.astype(block.dtype))
    return jax.tree.map(lambda g: g.astype(ds.dtype), grad)
