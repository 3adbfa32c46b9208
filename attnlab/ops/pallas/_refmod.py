"""A ``score_mod`` evaluated inside a kernel with its closed-over arrays left in memory.

Indexing a closed-over array with a traced index (``slopes[h]``, ``gate[b, h, q_idx]``)
traces to ``dynamic_slice`` / ``gather`` on a value, which the Pallas Triton lowering lacks.
``eval_with_refs`` runs the ``score_mod``'s jaxpr with each closed-over array as a *view* of
its kernel ref: ``dynamic_slice`` of size 1 fixes an index, ``squeeze`` drops the fixed axes,
and a point ``gather`` becomes one ref load with integer-array indices (clamped into range,
as XLA clamps), which Triton lowers to a pointer gather. Any other use of a view loads the
indexed part of the ref and continues with ordinary values, so the result is always the
``score_mod``'s; only the patterns above avoid a value-level gather.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    """A ``score_mod`` with its closed-over arrays hoisted: ``fn(s, b, h, q_idx, kv_idx,
    *consts)`` on one ``[tq, tk]`` block (scalar ``b``, ``h``), and the arrays ``consts``
    (``_common.convert_score_mod`` builds it)."""

    fn: Callable
    consts: tuple
    jaxpr: object = None  # the traced score_mod, its constants the hoisted arrays

    @property
    def float_consts(self) -> tuple[bool, ...]:
        return tuple(jnp.issubdtype(c.dtype, jnp.inexact) for c in self.consts)


@dataclasses.dataclass(frozen=True)
class _View:
    """``ref`` indexed per axis by ``("full",)`` or ``("at", index, kept)``."""

    ref: object
    dims: tuple

    @property
    def visible(self):
        return [i for i, d in enumerate(self.dims) if d[0] == "full" or d[2]]


def _load(view: _View):
    idx = []
    for size, d in zip(view.ref.shape, view.dims, strict=True):
        if d[0] == "full":
            idx.append(slice(None))
        elif d[2]:  # a fixed index kept as an axis of size 1
            idx.append(pl_ds(d[1], 1))
        else:
            idx.append(_clamp(d[1], size))
    return view.ref[tuple(idx)] if idx else view.ref[...]


def pl_ds(start, size):
    from jax.experimental import pallas as pl

    return pl.ds(start, size)


def _clamp(i, size):
    return jnp.clip(jnp.asarray(i, jnp.int32), 0, size - 1)


def _value(x):
    return _load(x) if isinstance(x, _View) else x


def _dynamic_slice(view: _View, starts, sizes):
    dims = list(view.dims)
    for axis, start, size in zip(view.visible, starts, sizes, strict=True):
        full = view.ref.shape[axis]
        if dims[axis][0] == "full" and size == 1:
            dims[axis] = ("at", _clamp(start, full), True)
        elif size != (1 if dims[axis][0] == "at" else full):
            return None
    return _View(view.ref, tuple(dims))


def _squeeze(view: _View, dimensions):
    dims = list(view.dims)
    visible = view.visible
    for d in dimensions:
        axis = visible[d]
        if dims[axis][0] != "at":
            return None
        dims[axis] = ("at", dims[axis][1], False)
    return _View(view.ref, tuple(dims))


def _components(indices_var, n, env, producers):
    """The ``n`` index arrays packed on the last axis of a gather's indices."""
    eqn = producers.get(indices_var)
    if eqn is None:
        return None
    parts = []
    if n == 1 and eqn.primitive is lax.broadcast_in_dim_p:
        parts = [eqn]
    elif eqn.primitive is lax.concatenate_p and len(eqn.invars) == n:
        parts = [producers.get(v) for v in eqn.invars]
    out = []
    for p in parts:
        if p is None or p.primitive is not lax.broadcast_in_dim_p:
            return None
        shape = p.params["shape"]
        if shape[-1] != 1 or (len(shape) - 1) in p.params["broadcast_dimensions"]:
            return None
        x = _read(p.invars[0], env)
        out.append(lax.broadcast_in_dim(_value(x), shape[:-1], p.params["broadcast_dimensions"]))
    return out if out else None


def _gather(view: _View, eqn, env, producers):
    dn = eqn.params["dimension_numbers"]
    n = len(view.visible)
    point = (
        dn.offset_dims == ()
        and dn.collapsed_slice_dims == tuple(range(n))
        and dn.start_index_map == tuple(range(n))
        and not dn.operand_batching_dims
        and all(s == 1 for s in eqn.params["slice_sizes"])
    )
    if not point:
        return None
    comps = _components(eqn.invars[1], n, env, producers)
    if comps is None:
        return None
    idx, it = [], iter(comps)
    for size, d in zip(view.ref.shape, view.dims, strict=True):
        if d[0] == "full" or d[2]:
            c = next(it)
            idx.append(_clamp(c, size) if d[0] == "full" else d[1] + 0 * c)
        else:
            idx.append(d[1])
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in idx))
    idx = [jnp.broadcast_to(i, shape) for i in idx]
    return view.ref[tuple(idx)]


def _read(v, env):
    if isinstance(v, Literal):
        return v.val
    x = env[v]
    return x() if isinstance(x, _Pending) else x


class _Pending:
    """An equation's output computed when first read."""

    def __init__(self, run, i):
        self.run, self.i = run, i

    def __call__(self):
        return self.run()[self.i]


def _index_only(jaxpr):
    """The variables read only as a gather's indices (and not returned)."""
    other, index = set(jaxpr.outvars), set()
    for eqn in jaxpr.eqns:
        for n, v in enumerate(eqn.invars):
            if not isinstance(v, Literal):
                (index if eqn.primitive is lax.gather_p and n == 1 else other).add(v)
    return index - other


def eval_with_refs(jaxpr, const_refs, *args):
    """``jaxpr(*args)`` with its constants read from ``const_refs`` (see the module)."""
    env, producers = {}, {}
    for var, ref in zip(jaxpr.constvars, const_refs, strict=True):
        env[var] = _View(ref, tuple(("full",) for _ in ref.shape))
    for var, x in zip(jaxpr.invars, args, strict=True):
        env[var] = x

    def run_eqn(eqn, done):
        if done:
            return done[0]
        prim, out = eqn.primitive, None
        first = _read(eqn.invars[0], env) if eqn.invars else None
        if isinstance(first, _View) and prim is lax.gather_p:  # its indices stay unbuilt
            out = _gather(first, eqn, env, producers)
        ins = [_read(v, env) for v in eqn.invars] if out is None else []
        if out is None and isinstance(first, _View):
            if prim is lax.dynamic_slice_p:
                out = _dynamic_slice(first, ins[1:], eqn.params["slice_sizes"])
            elif prim is lax.squeeze_p:
                out = _squeeze(first, eqn.params["dimensions"])
        if out is None:
            params = eqn.primitive.get_bind_params(eqn.params)
            out = eqn.primitive.bind(*[_value(x) for x in ins], **params)
        done.append(out if eqn.primitive.multiple_results else [out])
        return done[0]

    # An index array that only feeds gathers is built when one of them needs it as a value:
    # a gather done as a ref load reads its components instead, so the kernel holds no
    # concatenate of more than two arrays (``gate[b, h, q_idx]``), which Triton lacks.
    lazy = _index_only(jaxpr)
    for eqn in jaxpr.eqns:
        run = functools.partial(run_eqn, eqn, [])
        outs = None if all(v in lazy for v in eqn.outvars) else run()
        for i, var in enumerate(eqn.outvars):
            env[var] = _Pending(run, i) if outs is None else outs[i]
            producers[var] = eqn
    return [_value(_read(v, env)) for v in jaxpr.outvars]


def ref_score_fn(sm: ScoreMod):
    """``fn(s, b, h, q_idx, kv_idx, *const_refs)`` for a kernel body."""

    def fn(s, b, h, q_idx, kv_idx, *refs):
        (res,) = eval_with_refs(sm.jaxpr, refs, s, b, h, q_idx, kv_idx)
        return res.astype(jnp.float32)

    return fn
