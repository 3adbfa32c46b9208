"""Flex attention as Mosaic-TPU Pallas kernels that stream key/value blocks.

The structure of JAX's TPU flash and splash attention: a grid whose innermost axis walks the
visited blocks (``"arbitrary"``: sequential, accumulating in VMEM scratch), the block tables
as scalar prefetch so a BlockSpec's ``index_map`` fetches the ``t``-th non-empty block, and
every program holding ``O(block)`` memory:

* forward, grid ``(B, N, nq, steps_q)``: query block ``i`` of head ``n`` against the
  ``t``-th key block of row ``i`` (its PARTIAL blocks first, mask evaluated; then its FULL
  ones); online softmax in float32 scratch; output and log-sum-exp written at the last step;
* dQ, grid ``(B, N, nq, steps_q)``: the same visits, the weights recomputed from the saved
  log-sum-exp, ``dQ`` accumulated in scratch;
* dK/dV, grid ``(B, K, nk, G * steps_k)``: key block ``j`` of kv head ``kh`` against the
  ``t``-th query block of column ``j`` for each of the ``G`` query heads reading ``kh``.

Past a row's count the tables repeat its last visited block, so the pipeline issues no new
copy, and ``pl.when(t < count)`` skips the work; EMPTY blocks are never visited. Statistics
(log-sum-exp, ``delta``) are ``[B, N, T_pad, 128]``, broadcast over the lanes as in JAX's
flash attention, so their blocks tile. The arrays a ``score_mod`` closes over and the mask's
fields are read per block (``flex_tpu_mods``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas import flex_tpu_mods as mods

F32 = jnp.float32
LANES = 128


@dataclasses.dataclass(frozen=True)
class Config(cm.Blocks):
    """The static description of one call (padded sizes ``nq * tq``, ``nk * tk``)."""

    steps_q: int  # visits per query block (the longest row of the block mask)
    steps_k: int  # visits per key block (the longest column)
    scale: float
    softcap: float | None
    mod: Callable | None  # flex_tpu_mods.score_fn
    plan: mods.Plan | None
    stream_sizes: tuple  # per stream: sizes of its batch/head axes
    spec: tuple | None  # (causal, names) of a MaskSpec
    mask_names: tuple
    dense_shape: tuple
    has_sinks: bool
    interpret: bool


# ------------------------------------------------------------------------------------------
# Coordinates: (b, query head, query block, key block) of a program at a step
# ------------------------------------------------------------------------------------------


def _divmod(x, n):
    """Of non-negative int32 scalars, without ``jnp``'s floor-division (its sign op needs
    the chip's generation, unknown when lowering on another host)."""
    return jax.lax.div(x, jnp.int32(n)), jax.lax.rem(x, jnp.int32(n))


def _by_query(c):  # grid (b, n, i, t) with tables (kv_index, count, partial)
    def at(b, n, i, t, kvi, *_):
        return b, n, i, kvi[i * c.steps_q + t]

    return at


def _by_key(c):  # grid (b, kh, j, s) with tables (q_index, count, partial)
    def at(b, kh, j, s, qti, *_):
        g, t = _divmod(s, c.steps_k)
        return b, kh * c.G + g, qti[j * c.steps_k + t], j

    return at


def _spec(block, at, pick):
    return pl.BlockSpec(block, lambda *a: pick(*at(*a)))


def _q_spec(c, at, last=None):
    return _spec((None, None, c.tq, last or c.H), at, lambda b, h, qi, kj: (b, h, qi, 0))


def _kv_block(c):  # key block kj of the kv head read by query head h
    return lambda b, h, qi, kj: (b, jax.lax.div(h, jnp.int32(c.G)), kj, 0)


def _kv_spec(c, at):
    return _spec((None, None, c.tk, c.H), at, _kv_block(c))


def _smem():
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def extra_inputs(c: Config, at, mask_arrays, consts, streams):
    """``(arrays, specs)`` of the mask's fields, the score_mod's arrays and their streams."""
    arrays, specs = [], []
    for name, x in zip(c.mask_names, mask_arrays, strict=True):
        if name in cm._Q_ROW:
            arrays.append(x[:, :, None])
            specs.append(_spec((None, c.tq, 1), at, lambda b, h, qi, kj: (b, qi, 0)))
        elif name in cm._K_ROW:
            arrays.append(x[:, None, :])
            specs.append(_spec((None, 1, c.tk), at, lambda b, h, qi, kj: (b, 0, kj)))
        elif name in cm._PER_ROW or name == "window":  # [B, 1] or [1, 1]: 2-D in SMEM
            arrays.append(x.reshape(-1, 1))
            specs.append(_smem())
        else:  # dense [Bm, Nm, T_pad, S_pad]
            Bm, Nm = c.dense_shape
            arrays.append(x)
            pick = lambda b, h, qi, kj, Bm=Bm, Nm=Nm: (
                jnp.minimum(b, Bm - 1), jnp.minimum(h, Nm - 1), qi, kj)  # fmt: skip
            specs.append(_spec((None, None, c.tq, c.tk), at, pick))
    if c.plan is not None:
        for x, kind in zip(consts, c.plan.kinds, strict=True):
            if kind == "smem":
                arrays.append(mods.smem_array(x))
                specs.append(_smem())
            elif kind == "whole":
                arrays.append(x)
                specs.append(pl.BlockSpec(x.shape, lambda *_, nd=x.ndim: (0,) * nd))
        for st, x, sizes in zip(c.plan.streams, streams, c.stream_sizes, strict=True):
            specs.append(_spec(mods.stream_block(st, c.tq, c.tk), at,
                               functools.partial(mods.stream_index, st, sizes)))  # fmt: skip
            arrays.append(x)
    return arrays, specs


def _n_extra(c):
    if c.plan is None:
        return len(c.mask_names)
    return len(c.mask_names) + sum(k != "stream" for k in c.plan.kinds) + len(c.plan.streams)


class _Extras:
    """The extra refs of a program: mask fields, const refs, stream refs."""

    def __init__(self, c: Config, refs):
        nm = len(c.mask_names)
        self.mask = dict(zip(c.mask_names, refs[:nm], strict=True))
        refs = refs[nm:]
        self.consts, self.streams = [], []
        if c.plan is not None:
            it = iter(refs)
            self.consts = [None if k == "stream" else next(it) for k in c.plan.kinds]
            self.streams = list(it)


def _allowed(c: Config, ex: _Extras, b, qs, ks):
    """``[tq, tk]`` bool of a PARTIAL block (or None: nothing to mask)."""
    if c.dense_shape:
        ok = ex.mask["dense"][...] != 0
        if c.S_pad > c.S:
            ok = ok & (ks + jax.lax.broadcasted_iota(jnp.int32, (1, c.tk), 1) < c.S)
        return ok

    def get(name):
        r = ex.mask[name]
        if name in cm._Q_ROW or name in cm._K_ROW:
            return r[...]
        return r[0, 0] if name == "window" else r[b, 0]

    return mods.mask_block(c.spec, get, qs, ks, c.tq, c.tk, c.S, c.S_pad)


def _logits(c: Config, ex, s0, b, h, qs, ks):
    s = s0 if c.softcap is None else c.softcap * jnp.tanh(s0 / c.softcap)
    if c.mod is None:
        return s
    q_idx = qs + jax.lax.broadcasted_iota(jnp.int32, (c.tq, 1), 0)
    kv_idx = ks + jax.lax.broadcasted_iota(jnp.int32, (1, c.tk), 1)
    return c.mod(s, b, h, q_idx, kv_idx, ex.consts, ex.streams)


def _dot_t(a, b):  # a @ b.T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _dot_tn(a, b):  # a.T @ b
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


def _visit(t, count, partial, body):
    """``body(masked)`` at step ``t``: PARTIAL blocks come first in a row's visits."""
    pl.when(t < partial)(lambda: body(True))
    pl.when((t >= partial) & (t < count))(lambda: body(False))


# ------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------


def _fwd_kernel(kvi, cnt, pcnt, q_ref, k_ref, v_ref, *refs, c: Config):
    sinks_ref, refs = (refs[0], refs[1:]) if c.has_sinks else (None, refs)
    ne = _n_extra(c)
    ex = _Extras(c, refs[:ne])
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[ne:]
    b, n, i, t = (pl.program_id(a) for a in range(4))

    @pl.when(t == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, cm.NEG, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    qs, ks = i * c.tq, kvi[i * c.steps_q + t] * c.tk

    def body(masked):
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = _logits(c, ex, _dot_t(q, k) * c.scale, b, n, qs, ks)
        ok = _allowed(c, ex, b, qs, ks) if masked else None
        if ok is not None:
            s = jnp.where(ok, s, cm.NEG)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, s.max(-1, keepdims=True))
        p = jnp.exp(s - m_new[:, :1])
        if ok is not None:
            p = jnp.where(ok, p, 0.0)
        corr = jnp.exp(m_prev - m_new)
        l_sc[...] = l_sc[...] * corr + p.sum(-1, keepdims=True)
        m_sc[...] = m_new
        acc_sc[...] = acc_sc[...] * corr[:, :1] + jnp.dot(
            p.astype(v.dtype), v, preferred_element_type=F32
        )

    _visit(t, cnt[i], pcnt[i], body)

    @pl.when(t == c.steps_q - 1)
    def _():
        m, den, acc = m_sc[...], l_sc[...], acc_sc[...]
        if c.has_sinks:
            sink = sinks_ref[0, n]
            m_f = jnp.maximum(m, sink)
            corr = jnp.exp(m - m_f)
            acc, den, m = acc * corr[:, :1], den * corr + jnp.exp(sink - m_f), m_f
        live = den > 0
        safe = jnp.where(live, den, 1.0)
        o_ref[...] = (acc / safe[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(live, m + jnp.log(safe), 0.0)


def _call(kernel, c, grid, tables, in_specs, out_specs, out_shape, scratch, args, name):
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(tables),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
    )
    return pl.pallas_call(
        functools.partial(kernel, c=c),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=c.interpret,
        name=name,
    )(*tables, *args)


def forward(c: Config, tables_q, q, k, v, sinks, mask_arrays, consts, streams):
    """``(out[B, N, T_pad, H], lse[B, N, T_pad, 128])`` from ``BNTH`` padded inputs."""
    at = _by_query(c)
    in_specs = [_q_spec(c, at), _kv_spec(c, at), _kv_spec(c, at)]
    args = [q, k, v]
    if c.has_sinks:
        in_specs.append(_smem())
        args.append(sinks.astype(F32).reshape(1, c.N))
    arrays, specs = extra_inputs(c, at, mask_arrays, consts, streams)
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((c.B, c.N, c.T_pad, LANES), F32),
    ]
    scratch = [pltpu.VMEM((c.tq, LANES), F32), pltpu.VMEM((c.tq, LANES), F32),
               pltpu.VMEM((c.tq, c.H), F32)]  # fmt: skip
    return _call(_fwd_kernel, c, (c.B, c.N, c.nq, c.steps_q), tables_q, in_specs + specs,
                 [_q_spec(c, at), _q_spec(c, at, LANES)], out_shape, scratch, args + arrays,
                 "flex_tpu_fwd")  # fmt: skip


# ------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------


def _grad_block(c, ex, q, k, v, do, lse, delta, b, h, qs, ks, masked):
    """``(p, ds0)``: the block's weights and the cotangent of its scaled ``q.k``."""
    s0 = _dot_t(q, k) * c.scale
    s, pull = jax.vjp(lambda x: _logits(c, ex, x, b, h, qs, ks), s0)
    ok = _allowed(c, ex, b, qs, ks) if masked else None
    if c.T_pad > c.T:  # padded queries: a score_mod may give them anything, even NaN
        row = qs + jax.lax.broadcasted_iota(jnp.int32, (c.tq, 1), 0) < c.T
        ok = row if ok is None else ok & row
    p = jnp.exp(s - lse)
    if ok is not None:
        p = jnp.where(ok, p, 0.0)
    ds = p * (_dot_t(do, v) - delta)
    (ds0,) = pull(ds)
    if ok is not None:
        ds0 = jnp.where(ok, ds0, 0.0)
    return p, ds0


def _dq_kernel(kvi, cnt, pcnt, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, c):
    ne = _n_extra(c)
    ex = _Extras(c, refs[:ne])
    dq_ref, dq_sc = refs[ne:]
    b, n, i, t = (pl.program_id(a) for a in range(4))

    @pl.when(t == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    qs, ks = i * c.tq, kvi[i * c.steps_q + t] * c.tk

    def body(masked):
        k = k_ref[...]
        _, ds0 = _grad_block(c, ex, q_ref[...], k, v_ref[...], do_ref[...],
                             lse_ref[:, :1], delta_ref[:, :1], b, n, qs, ks, masked)  # fmt: skip
        dq_sc[...] += jnp.dot(ds0.astype(k.dtype), k, preferred_element_type=F32)

    _visit(t, cnt[i], pcnt[i], body)

    @pl.when(t == c.steps_q - 1)
    def _():
        dq_ref[...] = (dq_sc[...] * c.scale).astype(dq_ref.dtype)


def _dkv_kernel(qti, cnt, pcnt, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, c):
    ne = _n_extra(c)
    ex = _Extras(c, refs[:ne])
    dk_ref, dv_ref, dk_sc, dv_sc = refs[ne:]
    b, kh, j, s = (pl.program_id(a) for a in range(4))
    g, t = _divmod(s, c.steps_k)

    @pl.when(s == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    qs, ks = qti[j * c.steps_k + t] * c.tq, j * c.tk

    def body(masked):
        q, do = q_ref[...], do_ref[...]
        p, ds0 = _grad_block(c, ex, q, k_ref[...], v_ref[...], do, lse_ref[:, :1],
                             delta_ref[:, :1], b, kh * c.G + g, qs, ks, masked)  # fmt: skip
        dv_sc[...] += _dot_tn(p.astype(do.dtype), do)
        dk_sc[...] += _dot_tn(ds0.astype(q.dtype), q)

    _visit(t, cnt[j], pcnt[j], body)

    @pl.when(s == c.G * c.steps_k - 1)
    def _():
        dk_ref[...] = (dk_sc[...] * c.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def backward(c: Config, tables_q, tables_k, q, k, v, do, lse, delta, mask_arrays, consts,
             streams):  # fmt: skip
    """``(dq, dk, dv)`` in ``BNTH`` from padded inputs; ``lse``/``delta`` ``[B, N, T_pad, 128]``."""
    args = [q, k, v, do, lse, delta]
    at = _by_query(c)
    arrays, specs = extra_inputs(c, at, mask_arrays, consts, streams)
    in_specs = [_q_spec(c, at), _kv_spec(c, at), _kv_spec(c, at), _q_spec(c, at),
                _q_spec(c, at, LANES), _q_spec(c, at, LANES)]  # fmt: skip
    dq = _call(_dq_kernel, c, (c.B, c.N, c.nq, c.steps_q), tables_q, in_specs + specs,
               _q_spec(c, at), jax.ShapeDtypeStruct(q.shape, q.dtype),
               [pltpu.VMEM((c.tq, c.H), F32)], args + arrays, "flex_tpu_dq")  # fmt: skip
    at = _by_key(c)
    arrays, specs = extra_inputs(c, at, mask_arrays, consts, streams)
    in_specs = [_q_spec(c, at), _kv_spec(c, at), _kv_spec(c, at), _q_spec(c, at),
                _q_spec(c, at, LANES), _q_spec(c, at, LANES)]  # fmt: skip
    kv_out = _kv_spec(c, at)
    dk, dv = _call(
        _dkv_kernel, c, (c.B, c.K, c.nk, c.G * c.steps_k), tables_k, in_specs + specs,
        [kv_out, kv_out], [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
        [pltpu.VMEM((c.tk, c.H), F32)] * 2, args + arrays, "flex_tpu_dkv",
    )  # fmt: skip
    return dq, dk, dv
