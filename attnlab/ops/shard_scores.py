"""Score functions inside ``shard_map``: what ring and all-gather attention need to run a
``score_mod(score, b, h, q_idx, kv_idx)`` (``attnlab.ops.score_mods``) per block.

Inside ``shard_map`` every value has a type that says over which manual mesh axes it varies;
an array a score function closes over from outside (a per-head table, a gate's cumulative
sum) is the same on every device, and where it meets a varying value JAX casts it
(``pvary``), whose transpose is a ``psum``. Ring attention differentiates each block's
score function inside a ``lax.cond`` that skips the blocks the mask rules out, and a
collective there would wait for the devices that took the other branch. So ``trace``
takes the arrays out as explicit inputs (as ``score_mods.hoist`` does), the float ones are
cast to vary like the queries once, outside every branch (one ``psum`` of their gradient,
where the cast is transposed), and the traced program is evaluated with each primitive's
operands cast to their common manual axes (``_eval``): the casts recorded while tracing
are dropped, nested calls (``jit``, custom derivatives) are evaluated inline and shardings
recorded outside ``shard_map`` are left out, so the recorded types never have to match.
``context_parallel_attention`` traces outside ``shard_map`` (an array sharded over the
mesh cannot be closed over inside it) and passes the arrays in whole. A custom JVP or VJP
inside a score function is differentiated through its primal ops.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax

from attnlab.ops import score_mods

_CAST = frozenset({"pvary"})  # recorded casts to varying: redone where needed instead
_INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}  # fmt: skip
_SHARDINGS = frozenset({"sharding", "out_sharding"})  # of a trace outside: none inside


def _axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (none outside ``shard_map``)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)  # JAX 0.10; earlier releases: ``vma``
    return frozenset(kind.varying if kind is not None else getattr(aval, "vma", ()))


def _vary(x, axes):
    missing = tuple(sorted(axes - _axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _aligned(xs):
    """``xs`` (arrays or literals) cast to vary over the union of their manual axes."""
    xs = [jnp.asarray(x) for x in xs]
    union = frozenset().union(*map(_axes, xs))
    return [_vary(x, union) for x in xs] if union else xs


def _eval(jaxpr, consts, *args):
    """``jax.core.eval_jaxpr`` with each primitive's operands aligned (see the module)."""
    env = {}
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CAST:
            outs = ins
        elif name in _INLINE:
            inner = eqn.params[_INLINE[name]]
            outs = _eval(inner.jaxpr, inner.consts, *ins)
        else:
            if len(ins) > 1:
                ins = _aligned(ins)
            params = eqn.primitive.get_bind_params(eqn.params)  # shardings traced outside
            params = {k: None if k in _SHARDINGS else v for k, v in params.items()}
            outs = eqn.primitive.bind(*ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def trace(score_mod, example):
    """``(fn, args)``: ``score_mod`` traced on ``example`` (the score and the four index
    arrays of one block) with the arrays it closes over, of any dtype, hoisted out as
    ``args`` (``fn(score, b, h, q_idx, kv_idx, *args)``, evaluated as ``_eval`` does, so
    it runs inside ``shard_map`` whatever the manual axes of its inputs; traced outside,
    the arrays can enter ``shard_map`` as explicit inputs)."""
    score_mods.check_signature(score_mod)
    closed = jax.make_jaxpr(score_mod)(*example)
    jaxpr, n = closed.jaxpr, len(example)
    out = closed.out_avals
    if len(out) != 1 or out[0].shape != example[0].shape:
        got = out[0].shape if len(out) == 1 else f"{len(out)} outputs"
        raise ValueError(
            f"score_mod must return an array of the score's shape {example[0].shape} "
            f"(elementwise, no reduction or broadcast of a scalar); it returned {got}"
        )
    if not jnp.issubdtype(out[0].dtype, jnp.floating):
        raise ValueError(f"score_mod must return float logits; it returned {out[0].dtype}")

    def fn(*xs):
        (out,) = _eval(jaxpr, xs[n:], *xs[:n])
        return out

    return fn, tuple(jnp.asarray(c) for c in closed.consts)


def vary_floats(args, like):
    """The float ones of ``args`` cast to vary like ``like`` (the queries)."""
    axes = _axes(like)
    return tuple(_vary(a, axes) if jnp.issubdtype(a.dtype, jnp.inexact) else a for a in args)


def hoist(score_mod, example, like):
    """``trace`` inside ``shard_map``, the float arrays then cast to vary like ``like``."""
    fn, args = trace(score_mod, example)
    return fn, vary_floats(args, like)


def block_indices(B, K, G, q_meta, k_meta):
    """``(b, h, q_idx, kv_idx)`` of one block's ``[B, K, G, t, s]`` logits, rank-5 int32:
    this call's batch rows and query heads (``h = k * G + g``), and the tokens' indices
    (``"index"``, else their positions) ``[B|1, 1, 1, t, 1]`` and ``[B|1, 1, 1, 1, s]``."""
    i32 = jnp.int32
    q = q_meta.get("index", q_meta["pos"]).astype(i32)
    k = k_meta.get("index", k_meta["pos"]).astype(i32)
    b = jnp.arange(B, dtype=i32).reshape(B, 1, 1, 1, 1)
    h = jnp.arange(K * G, dtype=i32).reshape(1, K, G, 1, 1)
    return b, h, q[:, None, None, :, None], k[:, None, None, None, :]


def modded(mod, s_BKGTS, q_meta, k_meta, mod_args):
    """``mod`` (from ``hoist``) of one block's logits, their dtype kept; ``s`` without one."""
    if mod is None:
        return s_BKGTS
    B, K, G = s_BKGTS.shape[:3]
    idx = block_indices(B, K, G, q_meta, k_meta)
    return score_mods.apply(lambda *a: mod(*a, *mod_args), s_BKGTS, *idx)
