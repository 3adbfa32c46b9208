"""Flex attention as Pallas kernels in the Triton style: forward and backward, block-sparse.

``out = softmax(score_mod(softcap(scale * q.k)), masked, with sinks) v``, the meaning of
``attnlab.ops.flex``. Three kernels, each over a grid of programs:

* forward, grid ``(B, N, nq)``: one query block against the key blocks of its row of the
  ``BlockMask`` (PARTIAL ones with the mask evaluated, then FULL ones without), online
  softmax in float32, writing the output and the log-sum-exp (sinks included);
* dQ, grid ``(B, N, nq)``: the same visits, recomputing the weights from the saved
  log-sum-exp; the ``score_mod``'s derivative is ``jax.vjp`` of it on the block;
* dK/dV, grid ``(B, K, nk)``: one key block against the query blocks of its column, summing
  over the ``G`` query heads that read the kv head (keys and values are never repeated).

Inside the kernels the arrays a ``score_mod`` closes over stay in memory: indexing one entry
at a time (``slopes[h]``, ``gate[b, h, q_idx]``) becomes a ref load (``_refmod``), which the
Triton lowering takes where a gather on a value it does not; ``supports`` names a
``score_mod`` that would still need one.

Gradients of the arrays a ``score_mod`` closes over (hoisted into explicit inputs) come from
one more blockwise pass in plain JAX over the same non-empty blocks (``_const_grads``): it
recomputes the block's logits and ``dP`` (two block matmuls per visited block against the
kernels' seven: about 30% more backward matmul work, unfused) and applies the
``score_mod``'s vjp with respect to the arrays; it runs only when the ``score_mod`` closes
over float arrays. Its memory is one ``[B, N, tq, tk]`` block and the arrays' gradients,
never ``[T, S]``. (Per-program partial sums written by the dQ kernel would cost
``B N nq`` copies of every array: fine for per-head slopes, quadratic for a ``[B, N, T]``
gate.) Sink gradients come from the log-sum-exp in ``O(B N T)``.

``T`` and ``S`` need not divide the blocks: inputs are zero-padded and padded keys masked.
A query row with no allowed key gets a zero output and zero gradients. ``flex_tpu`` runs the
same kernels with Mosaic-TPU block shapes (``layout="BNTH"``, tables as scalar prefetch).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attnlab.errors import ConfigError
from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas import _refmod

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """The static description of one call."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    tq: int
    tk: int
    nq: int
    nk: int
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

    @property
    def G(self):
        return self.N // self.K

    @property
    def T_pad(self):
        return self.nq * self.tq

    @property
    def S_pad(self):
        return self.nk * self.tk


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

        def get(name):
            r = mrefs.get(name)
            if r is None:
                return None
            if name in cm._Q_ROW:
                return r[pl.ds(qs, c.tq)][None]
            if name in cm._K_ROW:
                return r[pl.ds(ks, c.tk)][None]
            return r[0] if name == "window" else r[...]

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


def _iota(n, axis):
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


def _fwd_kernel(*refs, c: Config):
    (po, pc, fo, fc), refs, outs = _split(refs, c, 3 if c.count else 2)
    q_ref, k_ref, v_ref, *refs = refs
    sinks_ref = refs.pop(0) if c.has_sinks else None
    mrefs, const_refs = _mask_refs(c, refs)
    o_ref, lse_ref = outs[:2]
    b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    qs = i * c.tq
    q = q_ref[...]
    consts = _consts(c, const_refs)
    q_idx = qs + _iota(c.tq, 0)

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
                ks + _iota(c.tk, 1),
                consts,
            )
            ok = None
            if masked:
                ok = _allowed(c, mrefs, qs, ks, lambda: mrefs["dense"][:, pl.ds(ks, c.tk)])
            if ok is not None:
                s = jnp.where(ok, s, cm.NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[:, None])
            if ok is not None:
                p = jnp.where(ok, p, 0.0)
            corr = jnp.exp(m - m_new)
            acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
            return acc, m_new, den * corr + p.sum(-1), nvis + 1, nmask + int(masked)

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
        outs[2][...] = jnp.stack([nvis, nmask])


def _grad_block(c, q, k, v, do, lse, delta, b, h, qs, ks, consts, ok):
    """``(p, ds0)``: the block's weights and the cotangent of its scaled ``q.k``."""
    s0 = _dot_t(q, k) * c.scale
    s, pull = jax.vjp(
        lambda x: cm.scores(
            x, c.softcap, c.mod_refs, b, h, qs + _iota(c.tq, 0), ks + _iota(c.tk, 1), consts
        ),  # fmt: skip
        s0,
    )
    if c.T_pad > c.T:  # padded queries: a score_mod may give them anything, even NaN
        row = qs + _iota(c.tq, 0) < c.T
        ok = row if ok is None else ok & row
    p = jnp.exp(s - lse[:, None])
    if ok is not None:
        p = jnp.where(ok, p, 0.0)
    ds = p * (_dot_t(do, v) - delta[:, None])
    (ds0,) = pull(ds)
    if ok is not None:
        ds0 = jnp.where(ok, ds0, 0.0)
    return p, ds0


def _dq_kernel(*refs, c: Config):
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


def _dkv_kernel(*refs, c: Config):
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


# ------------------------------------------------------------------------------------------
# BlockSpecs and calls
# ------------------------------------------------------------------------------------------


def _spec(shape, index_map):
    return pl.BlockSpec(shape, index_map)


def _whole(x):
    nd = x.ndim
    return _spec(x.shape, lambda *_: (0,) * nd)


def _q_block(c):  # grid (b, n, i)
    if c.layout == "BNTH":
        return _spec((None, None, c.tq, c.H), lambda b, n, i, *_: (b, n, i, 0))
    return _spec((None, c.tq, None, c.H), lambda b, n, i, *_: (b, i, n, 0))


def _kv_all(c):  # grid (b, n, i): every key of kv head n // G
    G = c.G
    if c.layout == "BNTH":
        return _spec((None, None, c.S_pad, c.H), lambda b, n, i, *_: (b, n // G, 0, 0))
    return _spec((None, c.S_pad, None, c.H), lambda b, n, i, *_: (b, 0, n // G, 0))


def _q_all(c):  # grid (b, kh, j): every query of the G heads reading kv head kh
    if c.layout == "BNTH":
        return _spec((None, c.G, c.T_pad, c.H), lambda b, kh, j, *_: (b, kh, 0, 0))
    return _spec((None, c.T_pad, c.G, c.H), lambda b, kh, j, *_: (b, 0, kh, 0))


def _kv_block(c):  # grid (b, kh, j)
    if c.layout == "BNTH":
        return _spec((None, None, c.tk, c.H), lambda b, kh, j, *_: (b, kh, j, 0))
    return _spec((None, c.tk, None, c.H), lambda b, kh, j, *_: (b, j, kh, 0))


def _mask_specs(c, by_key):
    """BlockSpecs of the mask inputs: for grid ``(b, n, i)``, or ``(b, kh, j)`` with
    ``by_key``. MaskSpec fields come one batch row at a time."""
    specs = []
    for name in c.mask_names:
        if name in cm._Q_ROW:
            specs.append(_spec((None, c.T_pad), lambda b, *_: (b, 0)))
        elif name in cm._K_ROW:
            specs.append(_spec((None, c.S_pad), lambda b, *_: (b, 0)))
        elif name in cm._PER_ROW:
            specs.append(_spec((None, 1), lambda b, *_: (b, 0)))
        elif name == "window":
            specs.append(_spec((1,), lambda *_: (0,)))
        else:  # dense [Bm, Nm, T_pad, S_pad]
            Bm, Nm = c.dense_shape
            pick_b = (lambda b: b) if Bm > 1 else (lambda b: 0)
            if not by_key:
                pick_n = (lambda n: n) if Nm > 1 else (lambda n: 0)
                specs.append(
                    _spec(
                        (None, None, c.tq, c.S_pad),
                        lambda b, n, i, *_, pb=pick_b, pn=pick_n: (pb(b), pn(n), i, 0),
                    )  # fmt: skip
                )
            elif Nm > 1:
                specs.append(
                    _spec(
                        (None, c.G, c.T_pad, c.tk),
                        lambda b, kh, j, *_, pb=pick_b: (pb(b), kh, 0, j),
                    )
                )
            else:
                specs.append(
                    _spec(
                        (None, None, c.T_pad, c.tk),
                        lambda b, kh, j, *_, pb=pick_b: (pb(b), 0, 0, j),
                    )
                )
    return specs


def _call(kernel, c, grid, tables, in_specs, out_specs, out_shape, args, name):
    if c.prefetch:
        from jax.experimental.pallas import tpu as pltpu

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
        )
        call = pl.pallas_call(
            functools.partial(kernel, c=c),
            grid_spec=grid_spec,
            out_shape=out_shape,
            interpret=c.interpret,
            name=name,
        )
        return call(*tables, *args)
    call = pl.pallas_call(
        functools.partial(kernel, c=c),
        grid=grid,
        in_specs=[_whole(t) for t in tables] + in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=c.interpret,
        name=name,
    )
    return call(*tables, *args)


def _stats_spec(c):
    return _spec((None, None, c.tq), lambda b, n, i, *_: (b, n, i))


def _forward(c: Config, tables, q, k, v, sinks, mask_arrays, consts):
    """``(out, lse[B, N, T_pad], counts)`` on padded inputs in ``c.layout``."""
    in_specs = [_q_block(c), _kv_all(c), _kv_all(c)]
    args = [q, k, v]
    if c.has_sinks:
        in_specs.append(_spec((c.N,), lambda *_: (0,)))
        args.append(sinks.astype(_F32))
    in_specs += _mask_specs(c, by_key=False) + [_whole(x) for x in consts]
    args += list(mask_arrays) + list(consts)
    out_specs = [_q_block(c), _stats_spec(c)]
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((c.B, c.N, c.T_pad), _F32),
    ]
    if c.count:
        out_specs.append(_spec((None, None, None, 2), lambda b, n, i, *_: (b, n, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((c.B, c.N, c.nq, 2), jnp.int32))
    outs = _call(_fwd_kernel, c, (c.B, c.N, c.nq), tables, in_specs, out_specs, out_shape,
                 args, "flex_fwd")  # fmt: skip
    return outs[0], outs[1], (outs[2] if c.count else None)


def _backward(c: Config, tables_q, tables_k, q, k, v, do, lse, delta, mask_arrays, consts):
    mspecs_q = _mask_specs(c, by_key=False)
    cspecs = [_whole(x) for x in consts]
    extra = list(mask_arrays) + list(consts)
    dq = _call(
        _dq_kernel,
        c,
        (c.B, c.N, c.nq),
        tables_q,
        [_q_block(c), _kv_all(c), _kv_all(c), _q_block(c), _stats_spec(c), _stats_spec(c)]
        + mspecs_q
        + cspecs,
        _q_block(c),
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        [q, k, v, do, lse, delta] + extra,
        "flex_dq",
    )
    stats_all = _spec((None, c.G, c.T_pad), lambda b, kh, j, *_: (b, kh, 0))
    dk, dv = _call(
        _dkv_kernel,
        c,
        (c.B, c.K, c.nk),
        tables_k,
        [_q_all(c), _kv_block(c), _kv_block(c), _q_all(c), stats_all, stats_all]
        + _mask_specs(c, by_key=True)
        + cspecs,
        [_kv_block(c), _kv_block(c)],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        [q, k, v, do, lse, delta] + extra,
        "flex_dkv",
    )
    return dq, dk, dv


# ------------------------------------------------------------------------------------------
# Gradients of the score_mod's arrays: a blockwise pass in plain JAX
# ------------------------------------------------------------------------------------------


def _const_grads(c: Config, tables, q, k, v, do, lse, delta, mask_arrays, consts, wants):
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

            def get(name):
                x = mods.get(name)
                if x is None:
                    return None
                if name in cm._Q_ROW:
                    return jax.lax.dynamic_slice_in_dim(x, qs, tq, 1)
                if name in cm._K_ROW:
                    return jax.lax.dynamic_slice_in_dim(x, ks, tk, 1)
                return x[:, 0] if name in cm._PER_ROW else x[0]  # the window

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
        q_idx = qs + _iota(tq, 0)

        def fn(j, acc):
            ks = j * tk
            k_j = jax.lax.dynamic_slice_in_dim(k, ks, tk, 1)
            v_j = jax.lax.dynamic_slice_in_dim(v, ks, tk, 1)
            s0 = jnp.einsum("BtKGH,BsKH->BKGts", q_i, k_j, preferred_element_type=_F32)
            s1 = cm.scores(s0.reshape(B, N, tq, tk) * c.scale, c.softcap, None, 0, 0, 0, 0, ())
            s, pull = jax.vjp(
                lambda *d: mod_all(s1, q_idx, ks + _iota(tk, 1), d), *[consts[n_] for n_ in idx]
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


# ------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------

DEFAULT_BLOCK = 64


def _pad_to(x, axis, size):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def supports(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    score_mod=None,
    mask=None,
    block_mask=None,
    scale=None,
    sinks=None,
    softcap=None,
    block_q=None,
    block_k=None,
    interpret=False,
    **_,
) -> str | None:
    """None when the kernel takes the call, else one line naming the argument."""
    if (reason := cm.check_common(q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask,
                                  sinks=sinks, softcap=softcap)) is not None:  # fmt: skip
        return f"{reason}; falling back to chunked"
    if block_mask is not None:
        block_q, block_k = block_mask.block_q, block_mask.block_k
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and not (isinstance(value, int) and value >= 1):
            return f"{name}={value!r}: must be a positive integer; falling back to chunked"
        if not interpret and value is not None and not cm.is_pow2(value, 16):
            return (
                f"{name}={value}: the Triton kernel takes powers of two >= 16; "
                "falling back to chunked"
            )
    if not interpret and score_mod is not None:
        missing = cm.triton_unlowerable(score_mod)
        if missing:
            return (
                f"score_mod: uses {', '.join(missing)}, which the Pallas Triton lowering "
                "lacks (closed-over arrays lower when indexed one entry at a time); "
                "falling back to chunked"
            )
    H = q_BTNH.shape[-1]
    if not interpret and not cm.is_pow2(H, 16):
        return (
            f"q_BTNH: head dim H={H} is not a power of two >= 16 (Triton tiles); "
            "falling back to chunked"
        )
    if not interpret and jax.default_backend() != "gpu":
        return "pallas_gpu: needs a GPU (or interpret=True); falling back to chunked"
    return None


def _config(
    q,
    k,
    *,
    mod,
    mod_refs,
    consts,
    mi,
    bm,
    scale,
    softcap,
    sinks,
    layout,
    prefetch,
    interpret,
    count,
):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    nq, nk = bm.shape
    dense_shape = mi.arrays[0].shape[:2] if mi.kind == "dense" else ()
    return Config(
        B=B, T=T, S=S, N=N, K=K, H=H, tq=bm.block_q, tk=bm.block_k, nq=nq, nk=nk,
        scale=cm.default_scale(scale, H), softcap=None if softcap is None else float(softcap),
        mod=mod, mod_refs=mod_refs, const_shapes=tuple(x.shape for x in consts), mask_kind=mi.kind,
        mask_names=mi.names, causal=mi.causal, dense_shape=tuple(dense_shape),
        has_sinks=sinks is not None, layout=layout, prefetch=prefetch, interpret=interpret,
        count=count,
    )  # fmt: skip


def _prepare(q, k, v, score_mod, mask, block_mask, block_q, block_k, reason_fn, kwargs):
    if (reason := reason_fn(q, k, v, **kwargs)) is not None:
        raise ConfigError(reason)
    B, T, N, H = q.shape
    S = k.shape[1]
    bq = DEFAULT_BLOCK if block_q is None else block_q
    bk = DEFAULT_BLOCK if block_k is None else block_k
    bm = cm.resolve_block_mask(mask, block_mask, T, S, bq, bk)
    sm = cm.convert_score_mod(score_mod, bm.block_q, bm.block_k)
    mi = cm.mask_inputs(mask, B, T, S, bm.T_pad, bm.S_pad)
    return bm, sm, mi


def attention(q, k, v, *, score_mod=None, mask=None, block_mask=None, scale=None, sinks=None,
              softcap=None, block_q=None, block_k=None, interpret=False, layout="BTNH",
              prefetch=False, count=False, reason_fn=None):  # fmt: skip
    """The kernels' shared entry: ``(out_BTNH, counts)``; see ``flex_attention_gpu``."""
    kw = dict(score_mod=score_mod, mask=mask, block_mask=block_mask, scale=scale, sinks=sinks,
              softcap=softcap, block_q=block_q, block_k=block_k, interpret=interpret)  # fmt: skip
    bm, sm, mi = _prepare(q, k, v, score_mod, mask, block_mask, block_q, block_k,
                          reason_fn or supports, kw)  # fmt: skip
    consts = () if sm is None else sm.consts
    wants = () if sm is None else sm.float_consts
    mod_refs = None if sm is None else _refmod.ref_score_fn(sm)
    c = _config(q, k, mod=None if sm is None else sm.fn, mod_refs=mod_refs, consts=consts,
                mi=mi, bm=bm,
                scale=scale, softcap=softcap, sinks=sinks, layout=layout, prefetch=prefetch,
                interpret=interpret, count=count)  # fmt: skip
    tables_q, tables_k = cm.split_tables(bm), cm.split_tables(bm, transpose=True)

    def to_layout(x, size):  # BTNH padded -> the kernel's layout
        x = _pad_to(x, 1, size)
        return x.transpose(0, 2, 1, 3) if layout == "BNTH" else x

    def from_layout(x, size):
        x = x.transpose(0, 2, 1, 3) if layout == "BNTH" else x
        return x[:, :size]

    def run_fwd(q, k, v, sinks, consts):
        out, lse, cnt = _forward(c, tables_q, to_layout(q, c.T_pad), to_layout(k, c.S_pad),
                                 to_layout(v, c.S_pad), sinks, mi.arrays, consts)  # fmt: skip
        return from_layout(out, c.T), lse, cnt

    sinks_arr = None if sinks is None else jnp.asarray(sinks)
    if count:  # forward only, with the visit counters
        out, _, cnt = run_fwd(q, k, v, sinks_arr, tuple(consts))
        return out, cnt

    @jax.custom_vjp
    def f(q, k, v, sinks, consts):
        return run_fwd(q, k, v, sinks, consts)[0]

    def f_fwd(q, k, v, sinks, consts):
        out, lse, _ = run_fwd(q, k, v, sinks, consts)
        return out, (q, k, v, sinks, consts, out, lse)

    def f_bwd(res, do):
        q, k, v, sinks, consts, out, lse = res
        delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(_F32), out.astype(_F32))
        delta = _pad_to(delta, 2, c.T_pad)
        qp, kp, vp, dop = (to_layout(x, n) for x, n in ((q, c.T_pad), (k, c.S_pad),
                                                         (v, c.S_pad), (do, c.T_pad)))  # fmt: skip
        dq, dk, dv = _backward(c, tables_q, tables_k, qp, kp, vp, dop.astype(q.dtype), lse,
                               delta, mi.arrays, consts)  # fmt: skip
        dq, dk, dv = from_layout(dq, c.T), from_layout(dk, c.S), from_layout(dv, c.S)
        dsinks = None
        if sinks is not None:  # d out / d sink = -p_sink * out
            p_sink = jnp.exp(sinks.astype(_F32)[None, :, None] - lse)
            dsinks = -(p_sink * delta).sum((0, 2)).astype(sinks.dtype)
        dconsts = tuple(None for _ in consts)
        if any(wants):
            dconsts = tuple(
                _const_grads(
                    c,
                    tables_q,
                    _pad_to(q, 1, c.T_pad),
                    _pad_to(k, 1, c.S_pad),
                    _pad_to(v, 1, c.S_pad),
                    _pad_to(do, 1, c.T_pad),
                    lse,
                    delta,
                    mi.arrays,
                    consts,
                    wants,
                )  # fmt: skip
            )
        return dq, dk, dv, dsinks, dconsts

    f.defvjp(f_fwd, f_bwd)
    return f(q, k, v, sinks_arr, tuple(consts)), None


def flex_attention_gpu(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    score_mod=None,
    mask=None,
    block_mask=None,
    scale=None,
    sinks=None,
    softcap=None,
    block_q=None,
    block_k=None,
    interpret: bool = False,
):
    """Flex attention through the Pallas (Triton-style) kernels: ``out_BTNH``.

    ``mask``: None, a ``MaskSpec`` or a dense bool ``[B|1, N|1, T, S]``; ``block_mask``: its
    ``BlockMask`` (else built here, shared by forward and backward); blocks default to 64.
    Differentiable in q, k, v, sinks and the float arrays ``score_mod`` closes over.
    """
    out, _ = attention(
        q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask, block_mask=block_mask,
        scale=scale, sinks=sinks, softcap=softcap, block_q=block_q, block_k=block_k,
        interpret=interpret,
    )  # fmt: skip
    return out


def visited_blocks(q_BTNH, k_BSKH, v_BSKH, **kwargs):
    """``(out_BTNH, counts[B, N, nq, 2])``: the forward kernel with, per program, the number
    of key blocks it visited and how many of them evaluated the mask (the PARTIAL ones)."""
    return attention(q_BTNH, k_BSKH, v_BSKH, count=True, **kwargs)
