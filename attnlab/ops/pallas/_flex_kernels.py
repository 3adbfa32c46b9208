"""The flex kernels' program bodies (``flex_gpu`` describes them) and ``Config``, the static
description of one call that the kernels, their calls (``_flex_calls``) and the gradient
pass of the ``score_mod``'s arrays (``_flex_grads``) share.

Inside a program ``q``, ``k``, ``v`` blocks are ``[tq | tk, H]``, logits ``[tq, tk]`` in
float32; every ``ref[pl.ds(start, size)]`` loads one tile of an array the call left in
memory, so a program holds O(block) data whatever ``T`` and ``S`` are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attnlab.ops.pallas import _common as cm

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config(cm.Blocks):
    """The static description of one call."""

    scale: float
    softcap: float | None
    mod: Callable | None  # on values (the JAX pass for the arrays' gradients)
    mod_refs: Callable | None  # on the arrays' refs (the kernels; see _refmod)
    const_shapes: tuple
    mask_kind: str | None
    mask_names: tuple
    causal: bool
    dense_shape: tuple  # (Bm, Nm) of a dense mask
    has_sinks: bool
    layout: str  # "BTNH": arrays as given (GPU); "BNTH": heads before time (Mosaic TPU)
    prefetch: bool  # block tables as scalar prefetch (Mosaic TPU)
    interpret: bool
    count: bool = False


# ------------------------------------------------------------------------------------------
# Inside a program
# ------------------------------------------------------------------------------------------


def _split(refs, c: Config, n_out):
    refs = list(refs)
    tables, refs = refs[:4], refs[4:]
    outs = refs[len(refs) - n_out :]
    refs = refs[: len(refs) - n_out]
    return tables, refs, outs


def _mask_refs(c: Config, refs):
    nm = len(c.mask_names)
    return dict(zip(c.mask_names, refs[:nm], strict=True)), refs[nm:]


def _allowed(c: Config, mrefs, qs, ks, dense_block):
    """``[tq, tk]`` bool for the PARTIAL block at query ``qs``, key ``ks``, or None."""
    out = None
    if c.mask_kind == "spec":
        get = cm.field_slices(
            mrefs,
            lambda r: r[pl.ds(qs, c.tq)][None],
            lambda r: r[pl.ds(ks, c.tk)][None],
            lambda name, r: r[0] if name == "window" else r[...],
        )
        out = cm.spec_block(c.causal, get, ks, c.tk, 1)[0]
    elif c.mask_kind == "dense":
        out = dense_block() != 0
    if c.S_pad > c.S:  # padded keys
        pad = ks + jax.lax.broadcasted_iota(jnp.int32, (1, c.tk), 1) < c.S
        out = pad if out is None else out & pad
    return out


def _consts(c: Config, const_refs):
    """The score_mod's arrays stay in memory: ``c.mod_refs`` reads what it indexes."""
    return list(const_refs)


def iota(n, axis):
    shape = (n, 1) if axis == 0 else (1, n)
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _dot_t(a, b):
    """``a @ b.T`` in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=_F32)


def _visits(order_ref, count_ref, row, fn, carry):
    """``fn(block, carry)`` over ``order_ref[row, :count_ref[row]]``."""
    return jax.lax.fori_loop(0, count_ref[row], lambda t, x: fn(order_ref[row, t], x), carry)


def fwd_kernel(*refs, c: Config):
    (po, pc, fo, fc), refs, outs = _split(refs, c, 3 if c.count else 2)
    q_ref, k_ref, v_ref, *refs = refs
    sinks_ref = refs.pop(0) if c.has_sinks else None
    mrefs, const_refs = _mask_refs(c, refs)
    o_ref, lse_ref = outs[:2]
    b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    qs = i * c.tq
    q = q_ref[...]
    consts = _consts(c, const_refs)
    q_idx = qs + iota(c.tq, 0)

    def visit(masked):
        def fn(j, carry):
            acc, m, den, nvis, nmask = carry
            ks = j * c.tk
            k, v = k_ref[pl.ds(ks, c.tk), :], v_ref[pl.ds(ks, c.tk), :]
            s = cm.scores(
                _dot_t(q, k) * c.scale,
                c.softcap,
                c.mod_refs,
                b,
                n,
                q_idx,
                ks + iota(c.tk, 1),
                consts,
            )
            ok = None
            if masked:
                ok = _allowed(c, mrefs, qs, ks, lambda: mrefs["dense"][:, pl.ds(ks, c.tk)])
            acc, m, den = cm.online_softmax(acc, m, den, s, ok, v)
            return acc, m, den, nvis + 1, nmask + int(masked)

        return fn

    carry = (
        jnp.zeros((c.tq, c.H), _F32),
        jnp.full((c.tq,), cm.NEG, _F32),
        jnp.zeros((c.tq,), _F32),
        jnp.int32(0),
        jnp.int32(0),
    )
    carry = _visits(po, pc, i, visit(True), carry)
    acc, m, den, nvis, nmask = _visits(fo, fc, i, visit(False), carry)
    if c.has_sinks:
        sink = sinks_ref[n]
        m_f = jnp.maximum(m, sink)
        corr = jnp.exp(m - m_f)
        acc, den, m = acc * corr[:, None], den * corr + jnp.exp(sink - m_f), m_f
    live = den > 0
    o_ref[...] = (acc / jnp.where(live, den, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(live, m + jnp.log(jnp.where(live, den, 1.0)), 0.0)
    if c.count:
        slot = jax.lax.broadcasted_iota(jnp.int32, (2,), 0)  # a stack of scalars: not in Triton
        outs[2][...] = jnp.where(slot == 0, nvis, nmask)


def _grad_block(c, q, k, v, do, lse, delta, b, h, qs, ks, consts, ok):
    """``(p, ds0)``: the block's weights and the cotangent of its scaled ``q.k``."""
    s0 = _dot_t(q, k) * c.scale
    s, pull = jax.vjp(
        lambda x: cm.scores(
            x, c.softcap, c.mod_refs, b, h, qs + iota(c.tq, 0), ks + iota(c.tk, 1), consts
        ),  # fmt: skip
        s0,
    )
    if c.T_pad > c.T:  # padded queries: a score_mod may give them anything, even NaN
        row = qs + iota(c.tq, 0) < c.T
        ok = row if ok is None else ok & row
    p = jnp.exp(s - lse[:, None])
    if ok is not None:
        p = jnp.where(ok, p, 0.0)
    ds = p * (_dot_t(do, v) - delta[:, None])
    (ds0,) = pull(ds)
    if ok is not None:
        ds0 = jnp.where(ok, ds0, 0.0)
    return p, ds0


def dq_kernel(*refs, c: Config):
    (po, pc, fo, fc), refs, (dq_ref,) = _split(refs, c, 1)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
    mrefs, const_refs = _mask_refs(c, refs)
    b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    qs = i * c.tq
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    consts = _consts(c, const_refs)

    def visit(masked):
        def fn(j, dq):
            ks = j * c.tk
            k, v = k_ref[pl.ds(ks, c.tk), :], v_ref[pl.ds(ks, c.tk), :]
            ok = None
            if masked:
                ok = _allowed(c, mrefs, qs, ks, lambda: mrefs["dense"][:, pl.ds(ks, c.tk)])
            _, ds0 = _grad_block(c, q, k, v, do, lse, delta, b, n, qs, ks, consts, ok)
            return dq + _dot(ds0.astype(k.dtype), k)

        return fn

    dq = _visits(po, pc, i, visit(True), jnp.zeros((c.tq, c.H), _F32))
    dq = _visits(fo, fc, i, visit(False), dq)
    dq_ref[...] = (dq * c.scale).astype(dq_ref.dtype)


def dkv_kernel(*refs, c: Config):
    (po, pc, fo, fc), refs, (dk_ref, dv_ref) = _split(refs, c, 2)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs = refs
    mrefs, const_refs = _mask_refs(c, refs)
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ks = j * c.tk
    k, v = k_ref[...], v_ref[...]
    consts = _consts(c, const_refs)
    heads_first = c.layout == "BNTH"

    def rows(ref, g, qs):  # the G heads' [tq, H] rows of q or dO
        return ref[g, pl.ds(qs, c.tq), :] if heads_first else ref[pl.ds(qs, c.tq), g, :]

    def dense(g, qs):
        ref = mrefs["dense"]
        return ref[g, pl.ds(qs, c.tq), :] if len(ref.shape) == 3 else ref[pl.ds(qs, c.tq), :]

    def visit(g, masked):
        def fn(i, carry):
            dk, dv = carry
            qs = i * c.tq
            q, do = rows(q_ref, g, qs), rows(do_ref, g, qs)
            lse, delta = lse_ref[g, pl.ds(qs, c.tq)], delta_ref[g, pl.ds(qs, c.tq)]
            ok = _allowed(c, mrefs, qs, ks, lambda: dense(g, qs)) if masked else None
            h = kh * c.G + g
            p, ds0 = _grad_block(c, q, k, v, do, lse, delta, b, h, qs, ks, consts, ok)
            dv = dv + jax.lax.dot_general(
                p.astype(do.dtype), do, (((0,), (0,)), ((), ())), preferred_element_type=_F32
            )
            dk = dk + jax.lax.dot_general(
                ds0.astype(q.dtype), q, (((0,), (0,)), ((), ())), preferred_element_type=_F32
            )
            return dk, dv

        return fn

    carry = (jnp.zeros((c.tk, c.H), _F32), jnp.zeros((c.tk, c.H), _F32))
    for g in range(c.G):
        carry = _visits(po, pc, j, visit(g, True), carry)
        carry = _visits(fo, fc, j, visit(g, False), carry)
    dk, dv = carry
    dk_ref[...] = (dk * c.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
