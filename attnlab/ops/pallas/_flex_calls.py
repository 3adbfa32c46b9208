"""The flex kernels' calls: their grids and BlockSpecs (arrays as given, ``BTNH``, or heads
before time, ``BNTH``) and the ``pallas_call`` with the lowering's compiler parameters.

On a GPU the calls pass Triton ``CompilerParams``, which select the Triton lowering (a plain
``pallas_call`` would go to Mosaic GPU; ``flex_gpu`` says why not). Their values follow
jax's own Triton attention (``jax/experimental/pallas/ops/gpu/attention.py``): the forward
kernel keeps a ``[tq, H]`` float32 accumulator, so 4 warps up to ``H = 64`` and 8 above;
the backward kernels hold several ``[tq, tk]`` float32 tiles at once (weights, ``dP``, their
product) and take 8 warps from ``tq * tk = 128 * 128``, 4 below. Two pipeline stages, as
there: the next tile's loads overlap the current tile's matmuls, and two stages of a
``[tk, H]`` key and value tile (64 KiB in bfloat16 at ``tk = 64``, ``H = 128``) fit in
shared memory beside the matmul operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas._flex_kernels import Config, dkv_kernel, dq_kernel, fwd_kernel

_F32 = jnp.float32


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


def _call(kernel, c, grid, tables, in_specs, out_specs, out_shape, args, name, num_warps):
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
        compiler_params=cm.triton_params(c.interpret, num_warps, num_stages=2),
        interpret=c.interpret,
        name=name,
    )
    return call(*tables, *args)


def _fwd_warps(c):
    return 4 if c.H <= 64 else 8


def _bwd_warps(c):
    return 4 if c.tq * c.tk < 128 * 128 else 8


def _stats_spec(c):
    return _spec((None, None, c.tq), lambda b, n, i, *_: (b, n, i))


def forward(c: Config, tables, q, k, v, sinks, mask_arrays, consts):
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
    outs = _call(fwd_kernel, c, (c.B, c.N, c.nq), tables, in_specs, out_specs, out_shape,
                 args, "flex_fwd", _fwd_warps(c))  # fmt: skip
    return outs[0], outs[1], (outs[2] if c.count else None)


def backward(c: Config, tables_q, tables_k, q, k, v, do, lse, delta, mask_arrays, consts):
    mspecs_q = _mask_specs(c, by_key=False)
    cspecs = [_whole(x) for x in consts]
    extra = list(mask_arrays) + list(consts)
    dq = _call(
        dq_kernel,
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
        _bwd_warps(c),
    )
    stats_all = _spec((None, c.G, c.T_pad), lambda b, kh, j, *_: (b, kh, 0))
    dk, dv = _call(
        dkv_kernel,
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
        _bwd_warps(c),
    )
    return dq, dk, dv
