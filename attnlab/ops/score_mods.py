"""Score functions: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, the hook by which an
attention variant changes its logits on every path (``attnlab.ops.flex``).

The contract. ``score`` holds float32 logits, already scaled (plus a dense ``bias``) and
capped by ``softcap``; ``b``, ``h``, ``q_idx`` and ``kv_idx`` are int32 arrays that broadcast
against it (of the same rank): the batch row, the *query* head ``n`` (``n = k * G + g`` with
grouped heads), the query's index in the queries passed (with a ``q_offset``, ``q_offset +
t``: its index among the keys when the queries continue a cache, as on the one-query
decoding path, where it is the query's cache position) and the key's index in the keys
passed. The result has ``score``'s shape and a float dtype; the mask is applied after it,
then the softmax (with sinks). The function is elementwise, so a blockwise kernel evaluates
it per block. It may close over arrays (a per-head bias, a position table, a gate's
output): they are differentiable inputs, and every path returns their gradients. Built-in
variants write theirs with the helpers below.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

SIGNATURE = "score_mod(score, b, h, q_idx, kv_idx)"


def check_signature(score_mod) -> None:
    """A ``ValueError`` naming ``score_mod`` unless it is a callable of five positional
    arguments."""
    if not callable(score_mod):
        raise ValueError(f"score_mod must be a callable {SIGNATURE}; got {score_mod!r}")
    try:
        sig = inspect.signature(score_mod)
    except (TypeError, ValueError):
        return  # builtins: nothing to inspect
    try:
        sig.bind(0, 0, 0, 0, 0)
    except TypeError:
        raise ValueError(
            f"score_mod must take five positional arguments, {SIGNATURE}; its signature is {sig}"
        ) from None


def indices(B, K, G, q_idx, kv_idx):
    """``(b, h, q_idx, kv_idx)`` as rank-5 int32 arrays broadcasting against ``[B, K, G, t, s]``
    logits, from the query and key indices ``[t]`` and ``[s]`` (or ``[B, t]`` per row)."""
    i32 = jnp.int32
    b = jnp.arange(B, dtype=i32).reshape(B, 1, 1, 1, 1)
    h = jnp.arange(K * G, dtype=i32).reshape(1, K, G, 1, 1)
    q_idx = jnp.asarray(q_idx, i32)
    q = q_idx.reshape(-1, 1, 1, q_idx.shape[-1], 1)  # [1|B, 1, 1, t, 1]
    kv = jnp.asarray(kv_idx, i32).reshape(1, 1, 1, 1, -1)
    return b, h, q, kv


def _examples(shape, q_rows):
    B, K, G, t, s = shape
    q_idx = jnp.zeros((q_rows, t), jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None]
    return indices(B, K, G, q_idx, jnp.arange(s, dtype=jnp.int32))


def check_result(score_mod, shape, q_rows: int = 1) -> None:
    """A ``ValueError`` naming ``score_mod`` unless it maps ``shape`` float32 logits (with
    index arrays of ``indices``, ``q_rows`` rows of query indices) to logits of that shape
    and a float dtype."""
    check_signature(score_mod)
    args = (jax.ShapeDtypeStruct(shape, jnp.float32),) + tuple(
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _examples(shape, q_rows)
    )
    out = jax.eval_shape(score_mod, *args)
    if not hasattr(out, "shape") or out.shape != tuple(shape):
        got = getattr(out, "shape", type(out).__name__)
        raise ValueError(
            f"score_mod must return an array of the score's shape {tuple(shape)} (elementwise, "
            f"no reduction or broadcast of a scalar); it returned {got}"
        )
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"score_mod must return float logits; it returned {out.dtype}")


def convert(score_mod, shape, q_rows: int = 1):
    """``(fn, consts)``: ``score_mod`` with the arrays it closes over hoisted out as ``consts``
    (``fn(score, b, h, q_idx, kv_idx, *consts)``), for logits of ``shape`` ``[B, K, G, t, s]``
    and ``q_rows`` rows of query indices (``jax.closure_convert``), so a custom backward
    pass can return their gradients."""
    example = (jnp.zeros(shape, jnp.float32),) + _examples(shape, q_rows)
    fn, consts = jax.closure_convert(score_mod, *example)
    return fn, tuple(consts)


def apply(score_mod, score, b, h, q_idx, kv_idx):
    """``score_mod``'s logits in float32."""
    return score_mod(score, b, h, q_idx, kv_idx).astype(jnp.float32)


def compose(first, then=None):
    """``then`` applied after ``first`` (None: ``first`` alone)."""
    if then is None:
        return first
    return lambda s, b, h, q, k: then(first(s, b, h, q, k), b, h, q, k)


# Built-in score functions (each closes over what it reads).


def softcap(cap: float):
    """``cap * tanh(s / cap)`` (Gemma 2); the op's own ``softcap`` argument does the same."""
    return lambda s, b, h, q, k: cap * jnp.tanh(s / cap)


def alibi(slopes_N, q_pos_BT=None, k_pos_BS=None):
    """ALiBi: ``s - slope_h * |q - k|`` over positions (default: the indices), as
    ``positions.alibi_bias``."""
    slopes_N = jnp.asarray(slopes_N, jnp.float32)

    def mod(s, b, h, q, k):
        qp = q if q_pos_BT is None else jnp.asarray(q_pos_BT)[b, q]
        kp = k if k_pos_BS is None else jnp.asarray(k_pos_BS)[b, k]
        return s - slopes_N[h] * jnp.abs(qp - kp).astype(jnp.float32)

    return mod


def head_bias(bias_N):
    """A learned logit offset per query head."""
    return lambda s, b, h, q, k: s + jnp.asarray(bias_N, jnp.float32)[h]


def forget_gate(cum_BNS):
    """The Forgetting Transformer's decay: ``s + c[q] - c[k]`` with ``c`` the cumulative log
    forget gate ``[B, N, S]`` over the keys' positions (the query's index is its key index:
    self-attention, training or decoding)."""
    return lambda s, b, h, q, k: s + cum_BNS[b, h, q] - cum_BNS[b, h, k]
