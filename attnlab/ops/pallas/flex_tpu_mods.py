"""What the Mosaic-TPU flex kernels read besides q, k and v: the mask's rules on one block and
the arrays a ``score_mod`` closes over, both streamed one block at a time.

A Mosaic kernel has no gather, and a program should hold ``O(block)`` memory, never a whole
head's positions or gate. So each closed-over array is read one of three ways, decided once
per call by ``plan_score_mod`` from the traced ``score_mod``:

* ``"stream"``: every use is a point gather whose indices are exactly ``b``, ``h``,
  ``q_idx`` or ``kv_idx`` (``gate[b, h, q_idx]``, ``q_pos[b, q_idx]``, ``rel[q_idx, kv_idx]``).
  The array is re-laid out as ``[b-axis?, h-axis?, T_pad|1, S_pad|1]`` (one copy per distinct
  use) and a BlockSpec hands the program the block of its ``(b, h, query block, key block)``;
  the gather becomes that block's load. The roles are found by evaluating the gather's
  indices on probe values, so index normalisation (``where(i < 0, i + n, i)``) is seen through.
* ``"smem"``: every use reads single entries with scalar indices (``slopes[h]``: a
  ``dynamic_slice`` of size 1): the whole (small) array sits in SMEM as float32/int32.
* ``"whole"``: anything else: the whole array in VMEM, read as in ``_refmod``. Pallas
  interpret mode takes it; Mosaic does not (no gather), so ``supports`` refuses it.

Inside a kernel ``score_fn`` evaluates the ``score_mod``'s jaxpr on ``[tq, tk]`` logits with
only the equations its result needs (index arithmetic feeding a streamed gather is dropped).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas import _refmod

ROLES = ("b", "h", "q", "k")
SMEM_MAX = 1 << 14  # entries: a per-head or per-row table, never a sequence


@dataclasses.dataclass(frozen=True)
class Stream:
    """One streamed copy of closed-over array ``const``: its axes' roles, in ``ROLES`` order
    after ``perm``."""

    const: int
    roles: tuple  # per axis of the const, in the const's axis order
    perm: tuple  # the const's axes in canonical order

    @property
    def canon(self):
        return tuple(self.roles[a] for a in self.perm)


@dataclasses.dataclass(frozen=True)
class Plan:
    kinds: tuple  # per const: "stream" | "smem" | "whole"
    streams: tuple  # Stream, each input once
    gathers: tuple  # (eqn index, stream index)
    live: frozenset  # eqn indices the result needs

    def unsupported(self):
        return [i for i, k in enumerate(self.kinds) if k == "whole"]


def _probe_args(B, N, tq, tk, T_pad, S_pad):
    """A few ``(b, h, q_idx, kv_idx)`` with distinct values per role where the sizes allow."""
    out = []
    qs_all = sorted({0, max(T_pad - tq, 0)})
    ks_all = sorted({0, max(S_pad - tk, 0)})
    for b, h, qs, ks in itertools.product(sorted({0, B - 1}), sorted({0, N - 1, N // 2}),
                                          qs_all, ks_all):  # fmt: skip
        q_idx = qs + np.arange(tq, dtype=np.int32)[:, None]
        kv_idx = ks + np.arange(tk, dtype=np.int32)[None, :]
        out.append(dict(b=np.int32(b), h=np.int32(h), q=q_idx, k=kv_idx))
    return out


def _record_gathers(jaxpr, consts, probe, tq, tk):
    """``{eqn index: index array}`` of the gathers reading a const directly, on one probe."""
    env, seen = {}, {}
    const_vars = set(jaxpr.constvars)
    for var, x in zip(jaxpr.constvars, consts, strict=True):
        env[var] = jnp.zeros(x.shape, x.dtype)
    args = (jnp.zeros((tq, tk), jnp.float32), probe["b"], probe["h"], probe["q"], probe["k"])
    for var, x in zip(jaxpr.invars, args, strict=True):
        env[var] = jnp.asarray(x)
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    for n, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive is lax.gather_p and eqn.invars[0] in const_vars:
            seen[n] = np.asarray(ins[1])
        out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
        for var, o in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out],
                          strict=True):  # fmt: skip
            env[var] = o
    return seen


def _point_gather(eqn, ndim):
    dn = eqn.params["dimension_numbers"]
    return (
        dn.offset_dims == ()
        and dn.collapsed_slice_dims == tuple(range(ndim))
        and dn.start_index_map == tuple(range(ndim))
        and not dn.operand_batching_dims
        and len(eqn.outvars[0].aval.shape) == 2
    )


def _roles_of(records, n, ndim):
    """The role of each of the gather's ``ndim`` index components, or None."""
    roles = []
    for a in range(ndim):
        cands = set(ROLES)
        for probe, seen in records:
            comp = seen[n][..., a]
            for r in list(cands):
                x = np.asarray(probe[r])
                try:
                    fits = np.broadcast_shapes(x.shape, comp.shape) == comp.shape
                except ValueError:
                    fits = False
                if not fits or not np.array_equal(comp, np.broadcast_to(x, comp.shape)):
                    cands.discard(r)
        if not cands:
            return None
        roles.append(min(cands, key=ROLES.index))
    return tuple(roles) if len(set(roles)) == len(roles) else None


def plan_score_mod(sm, *, B, N, tq, tk, T_pad, S_pad) -> Plan:
    """How each of ``sm``'s closed-over arrays is read (see the module docstring)."""
    jaxpr = sm.jaxpr
    with cm.eager():
        records = [
            (p, _record_gathers(jaxpr, sm.consts, p, tq, tk))
            for p in _probe_args(B, N, tq, tk, T_pad, S_pad)
        ]
    uses = {v: [] for v in jaxpr.constvars}
    for n, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jax.extend.core.Literal) and v in uses:
                uses[v].append(n)
    kinds, streams, gathers = [], [], []
    for c, var in enumerate(jaxpr.constvars):
        eqns = [jaxpr.eqns[n] for n in uses[var]]
        x = sm.consts[c]
        mine = []
        for n, eqn in zip(uses[var], eqns, strict=True):
            if eqn.primitive is not lax.gather_p or not _point_gather(eqn, x.ndim):
                break
            roles = _roles_of(records, n, x.ndim)
            if roles is None:
                break
            mine.append((n, roles))
        if eqns and len(mine) == len(eqns):
            kinds.append("stream")
            for n, roles in mine:
                perm = tuple(sorted(range(x.ndim), key=lambda a, r=roles: ROLES.index(r[a])))
                st = Stream(c, roles, perm)
                if st not in streams:
                    streams.append(st)
                gathers.append((n, streams.index(st)))
        elif (
            eqns
            and x.size <= SMEM_MAX
            and all(
                e.primitive is lax.dynamic_slice_p and all(s == 1 for s in e.params["slice_sizes"])
                for e in eqns
            )
        ):
            kinds.append("smem")
        else:
            kinds.append("whole")
    gathers = tuple(gathers)
    return Plan(tuple(kinds), tuple(streams), gathers, _live(jaxpr, dict(gathers)))


def _live(jaxpr, streamed):
    need = {v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal)}
    live = set()
    for n in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[n]
        if not any(v in need for v in eqn.outvars):
            continue
        live.add(n)
        if n in streamed:
            continue  # its indices are the block's own: nothing upstream is needed
        need.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
    return frozenset(live)


# ------------------------------------------------------------------------------------------
# The arrays as kernel inputs
# ------------------------------------------------------------------------------------------


def _fit(x, axis, size):
    """``x`` along ``axis`` cut or edge-padded to ``size`` (a gather clamps its index)."""
    n = x.shape[axis]
    if n >= size:
        return lax.slice_in_dim(x, 0, size, axis=axis)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - n)
    return jnp.pad(x, widths, mode="edge")


def stream_array(st: Stream, x, T_pad, S_pad):
    """``x`` laid out for ``st``: ``[b?, h?, T_pad|1, S_pad|1]``, float32 or int32 (32-bit
    tiles; the kernel casts a block back to the traced dtype)."""
    y = jnp.transpose(x, st.perm)
    y = y.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.int32)
    canon = st.canon
    if "q" not in canon:
        y = y[..., None, :] if "k" in canon else y[..., None]
    if "k" not in canon:
        y = y[..., None]
    nd = y.ndim
    if "q" in canon:
        y = _fit(y, nd - 2, T_pad)
    if "k" in canon:
        y = _fit(y, nd - 1, S_pad)
    return y


def smem_array(x):
    """``x`` as ``[1, size]`` float32/int32 for SMEM (2-D: Mosaic tiles every block)."""
    x = x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.int32)
    return x.reshape(1, -1)


class FlatRef:
    """An SMEM ref ``[1, size]`` seen with its array's own ``shape``: scalar indices become
    one flat index."""

    def __init__(self, ref, shape):
        self.ref, self.shape = ref, tuple(shape)
        self.dtype = ref.dtype

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        scalar = lambda i: isinstance(i, int) or getattr(i, "shape", None) == ()
        if not all(scalar(i) for i in idx) or len(idx) != len(self.shape):
            return self.ref[...].reshape(self.shape)[idx]  # not a scalar read: interpret only
        flat, stride = 0, 1
        for i, n in zip(reversed(idx), reversed(self.shape), strict=True):
            flat, stride = flat + i * stride, stride * n
        return self.ref[0, flat]


def stream_block(st: Stream, tq, tk):
    """The BlockSpec block shape of ``st``'s array."""
    canon = st.canon
    lead = tuple(None for r in canon if r in "bh")
    return lead + (tq if "q" in canon else 1, tk if "k" in canon else 1)


def stream_index(st: Stream, sizes, b, h, qi, kj):
    """The block index of ``st``'s array for batch row ``b``, query head ``h``, query block
    ``qi`` and key block ``kj`` (batch/head axes of size 1 broadcast)."""
    canon = st.canon
    idx = []
    for a, r in enumerate(r for r in canon if r in "bh"):
        v = b if r == "b" else h
        idx.append(jnp.minimum(v, sizes[a] - 1))
    return tuple(idx) + (qi if "q" in canon else 0, kj if "k" in canon else 0)


# ------------------------------------------------------------------------------------------
# Inside a kernel
# ------------------------------------------------------------------------------------------


def score_fn(sm, plan: Plan):
    """``fn(s, b, h, q_idx, kv_idx, const_refs, stream_refs) -> [tq, tk]`` float32."""
    jaxpr = sm.jaxpr
    gathers = dict(plan.gathers)

    def fn(s, b, h, q_idx, kv_idx, const_refs, stream_refs):
        env = {}
        for var, ref, kind in zip(jaxpr.constvars, const_refs, plan.kinds, strict=True):
            if kind == "smem":
                ref = FlatRef(ref, var.aval.shape)
            if kind != "stream":
                env[var] = _refmod._View(ref, tuple(("full",) for _ in ref.shape))
        for var, x in zip(jaxpr.invars, (s, b, h, q_idx, kv_idx), strict=True):
            env[var] = x
        producers = {}
        for n, eqn in enumerate(jaxpr.eqns):
            if n not in plan.live:
                continue
            if n in gathers:
                aval = eqn.outvars[0].aval
                x = stream_refs[gathers[n]][...]
                x = x.reshape(x.shape[-2:]) if x.ndim > 2 else x
                env[eqn.outvars[0]] = jnp.broadcast_to(x, aval.shape).astype(aval.dtype)
                continue
            ins = [_refmod._read(v, env) for v in eqn.invars]
            out = None
            if ins and isinstance(ins[0], _refmod._View):
                if eqn.primitive is lax.dynamic_slice_p:
                    out = _refmod._dynamic_slice(ins[0], ins[1:], eqn.params["slice_sizes"])
                elif eqn.primitive is lax.squeeze_p:
                    out = _refmod._squeeze(ins[0], eqn.params["dimensions"])
                elif eqn.primitive is lax.gather_p:
                    out = _refmod._gather(ins[0], eqn, env, producers)
            if out is None:
                vals = [_value(x, v) for x, v in zip(ins, eqn.invars, strict=True)]
                out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
            outs = out if eqn.primitive.multiple_results else [out]
            for var, o in zip(eqn.outvars, outs, strict=True):
                env[var] = o
                producers[var] = eqn
        (res,) = [_refmod._read(v, env) for v in jaxpr.outvars]
        return _value(res, jaxpr.outvars[0]).astype(jnp.float32)

    return fn


def _value(x, var):
    """A view's value in its traced dtype (SMEM holds float32/int32)."""
    if not isinstance(x, _refmod._View):
        return x
    y = _refmod._load(x)
    dtype = getattr(getattr(var, "aval", None), "dtype", y.dtype)
    return y.astype(dtype) if y.dtype != dtype else y


def mask_block(spec, get, qs, ks, tq, tk, S, S_pad):
    """``[tq, tk]`` bool: MaskSpec's rules (``masks.MaskSpec``) on the block at query ``qs``,
    key ``ks``, with padded keys (index ``>= S``) masked. ``get(name)`` gives a field's block
    (``[tq, 1]`` query rows, ``[1, tk]`` key rows, scalars per row and the window) or None;
    ``spec`` is None for no mask."""
    k_index = ks + lax.broadcasted_iota(jnp.int32, (1, tk), 1)
    out = k_index < S if S_pad > S else None
    if spec is None:
        return out
    causal, names = spec
    f = {n: (get(n) if n in names else None) for n in
         ("q_pos", "k_pos", "window", "q_segment", "k_segment", "k_length", "k_valid",
          "q_valid", "prefix_length")}  # fmt: skip
    p = f["q_pos"] if f["q_pos"] is not None else qs + lax.broadcasted_iota(jnp.int32, (tq, 1), 0)
    k = f["k_pos"] if f["k_pos"] is not None else k_index
    rules = []
    if causal:
        rule = k <= p
        if f["prefix_length"] is not None:
            rule = rule | (k < f["prefix_length"])
        rules.append(rule)
    if f["window"] is not None:
        rules.append((k <= p) & (k > p - f["window"]))
    if f["q_segment"] is not None:
        qg, kg = f["q_segment"], f["k_segment"]
        rules.append((qg == kg) & (qg > 0) & (kg > 0))
    if f["k_length"] is not None:
        rules.append(k_index < f["k_length"])
    if f["k_valid"] is not None:
        rules.append(f["k_valid"] != 0)
    if f["q_valid"] is not None:
        rules.append(f["q_valid"] != 0)
    for r in rules:
        out = r if out is None else out & r
    return None if out is None else jnp.broadcast_to(out, (tq, tk))


def ceil_to(x, m):
    return m * math.ceil(x / m)


class _BlockRef:
    """Stands in for a stream's block ref while the kernel's score function is traced."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype

    def __getitem__(self, idx):
        return jnp.zeros(self.shape, self.dtype)


def mosaic_unlowerable(sm, plan: Plan, tq, tk):
    """The primitives the kernel would run for ``sm`` (``score_fn`` traced on a ``[tq, tk]``
    block) that the Mosaic TPU lowering has no rule for, sorted; empty when it lowers."""
    from jax._src.pallas.mosaic import lowering

    from attnlab.ops.pallas import _common as cm

    fn = score_fn(sm, plan)
    const_refs = [
        cm._ShapeRef(smem_array(x) if kind == "smem" else x)
        for x, kind in zip(sm.consts, plan.kinds, strict=True)
    ]
    stream_refs = [_BlockRef(stream_block(st, tq, tk)[-2:], jnp.float32) for st in plan.streams]
    i32 = jnp.int32
    closed = jax.make_jaxpr(lambda *a: fn(*a, const_refs, stream_refs))(
        jnp.zeros((tq, tk), jnp.float32), i32(0), i32(0),
        jnp.zeros((tq, 1), i32), jnp.zeros((1, tk), i32),
    )  # fmt: skip
    rules = set()
    for table in lowering.lowering_rules.values():
        rules |= set(table)
    return sorted({p.name for p in _primitives(closed.jaxpr) if p not in rules})


def _primitives(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn.primitive
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _primitives(inner)
