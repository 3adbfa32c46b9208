"""Gradients of the arrays a ``score_mod`` closes over: one blockwise pass in plain JAX over
the non-empty blocks the kernels visit (``flex_gpu`` gives its cost and why it is not a
kernel). Memory: one ``[B, N, tq, tk]`` block and the arrays' gradients, never ``[T, S]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas._flex_kernels import Config, iota

_F32 = jnp.float32


def const_grads(c: Config, tables, q, k, v, do, lse, delta, mask_arrays, consts, wants):
    """d consts (float32) for the consts flagged in ``wants``, from BTNH padded inputs."""
    B, N, K, G, H, tq, tk = c.B, c.N, c.K, c.G, c.H, c.tq, c.tk
    po, pc, fo, fc = tables
    mods = dict(zip(c.mask_names, mask_arrays, strict=True))
    idx = [n for n, w in enumerate(wants) if w]
    b_B, h_N = jnp.arange(B, dtype=jnp.int32), jnp.arange(N, dtype=jnp.int32)

    def mod_all(s_BNtT, q_idx, kv_idx, diff):  # the block's score_mod over every (b, h)
        cs = list(consts)
        for n_, x in zip(idx, diff, strict=True):
            cs[n_] = x
        one = lambda s, b, h: c.mod(s, b, h, q_idx, kv_idx, *cs)
        return jax.vmap(jax.vmap(one, (0, None, 0)), (0, 0, None))(s_BNtT, b_B, h_N)

    def allowed(qs, ks):
        out = None
        if c.mask_kind == "spec":
            get = cm.field_slices(
                mods,
                lambda x: jax.lax.dynamic_slice_in_dim(x, qs, tq, 1),
                lambda x: jax.lax.dynamic_slice_in_dim(x, ks, tk, 1),
                lambda name, x: x[:, 0] if name in cm._PER_ROW else x[0],  # or the window
            )
            out = cm.spec_block(c.causal, get, ks, tk, B)[:, None]
        elif c.mask_kind == "dense":
            x = jax.lax.dynamic_slice_in_dim(mods["dense"], qs, tq, 2)
            out = jax.lax.dynamic_slice_in_dim(x, ks, tk, 3) != 0
        if c.S_pad > c.S:
            pad = (ks + jnp.arange(tk) < c.S)[None, None, None, :]
            out = pad if out is None else out & pad
        return out

    def visit(i, masked):
        qs = i * tq
        q_i = jax.lax.dynamic_slice_in_dim(q, qs, tq, 1).reshape(B, tq, K, G, H)
        do_i = jax.lax.dynamic_slice_in_dim(do, qs, tq, 1).reshape(B, tq, K, G, H)
        lse_i = jax.lax.dynamic_slice_in_dim(lse, qs, tq, 2)[..., None]
        delta_i = jax.lax.dynamic_slice_in_dim(delta, qs, tq, 2)[..., None]
        q_idx = qs + iota(tq, 0)

        def fn(j, acc):
            ks = j * tk
            k_j = jax.lax.dynamic_slice_in_dim(k, ks, tk, 1)
            v_j = jax.lax.dynamic_slice_in_dim(v, ks, tk, 1)
            s0 = jnp.einsum("BtKGH,BsKH->BKGts", q_i, k_j, preferred_element_type=_F32)
            s1 = cm.scores(s0.reshape(B, N, tq, tk) * c.scale, c.softcap, None, 0, 0, 0, 0, ())
            s, pull = jax.vjp(
                lambda *d: mod_all(s1, q_idx, ks + iota(tk, 1), d), *[consts[n_] for n_ in idx]
            )
            p = jnp.exp(s - lse_i)
            ok = allowed(qs, ks) if masked else None  # FULL blocks hold no padded key
            if c.T_pad > c.T:
                row = (q_idx < c.T)[None, None]
                ok = row if ok is None else ok & row
            if ok is not None:
                p = jnp.where(ok, p, 0.0)
            dp = jnp.einsum("BtKGH,BsKH->BKGts", do_i, v_j, preferred_element_type=_F32)
            ds = p * (dp.reshape(B, N, tq, tk) - delta_i)
            return tuple(a + g.astype(_F32) for a, g in zip(acc, pull(ds), strict=True))

        return fn

    def row(i, acc):
        acc = _visit_rows(po, pc, i, visit(i, True), acc)
        return _visit_rows(fo, fc, i, visit(i, False), acc)

    acc = tuple(jnp.zeros(consts[n_].shape, _F32) for n_ in idx)
    acc = jax.lax.fori_loop(0, c.nq, row, acc)
    out = [None] * len(consts)
    for n_, g in zip(idx, acc, strict=True):
        out[n_] = g.astype(consts[n_].dtype)
    return out


def _visit_rows(order, count, row, fn, carry):
    return jax.lax.fori_loop(0, count[row], lambda t, x: fn(order[row, t], x), carry)
