"""Score functions: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, the hook by which an
attention variant changes its logits on every path (``attnlab.ops.flex``).

The contract. ``score`` holds float32 logits, already scaled (plus a dense ``bias``) and
capped by ``softcap``; ``b``, ``h``, ``q_idx`` and ``kv_idx`` are int32 arrays that broadcast
against it (of the same rank): the batch row, the *query* head ``n`` (``n = k * G + g`` with
grouped heads), and the query's and the key's **absolute positions in the sequence**. The
result has ``score``'s shape and a float dtype; the mask is applied after it, then the
softmax (with sinks). The function is elementwise, so a blockwise kernel evaluates it per
block.

Positions, not slots. Through ``attnlab.ops.dot_product_attention`` (every mixer, every
registered attention function) the indices are the positions the call's ``MaskSpec``
gives its queries and keys (``at_positions``): training (token ``t`` at ``t``), a linear
cache (slot ``s`` holds position ``s``; a prefill after a prompt, a chunk of a chunked
prefill, a decoding step and a speculative verification pass all see their queries at
``lengths + t``), a ring-buffer cache (slot ``s`` holds the latest position ``p`` with
``p % W == s``, and a longer call's own keys follow the ring), ragged rows (each row its
own positions). So ``q_idx - kv_idx`` is the distance between the tokens however the cache
lays them out, and a variant decodes with the scores it trained with. ``flex_attention``
called directly takes the arrays as they are: its indices are ``q_offset + t`` and ``s``,
the positions when the keys are a sequence or a linear cache; wrap the function with
``at_positions`` for keys laid out otherwise.

A variant that keeps a per-key array laid out like the keys it passes (a cached state
per slot, a value per key of the call) indexes it by the key's *index* among those keys,
not by its position: ``kv_cache.LayerCache.key_index(b, kv_idx, T)`` maps a position back
to it (the position itself for a linear cache; in a ring, slot ``p % W`` for a decoding
step, and ``W + p - start`` for the own keys of a longer call, which follow the ring).

Closures. The function may close over arrays of any dtype: a per-head bias, a gate's
output, a position table, a per-call integer offset or a boolean flag. Every path hoists
them out as explicit inputs (``hoist``), so a custom backward pass (the chunked path, the
kernels, a ``lax.scan`` over layers around either) returns their gradients: the float
ones their own, integer and boolean ones none (``float0``). Built-in variants write theirs
with the helpers below.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

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


def hoist(fn, *example):
    """``(fn_c, consts)``: ``fn`` (arrays in, one array out) traced on ``example`` with every
    array it closes over, of any dtype, hoisted out as ``consts`` (``fn_c(*args, *consts)``),
    so a custom VJP takes them as inputs and nothing traced escapes its backward pass.
    (``jax.closure_convert`` hoists only floating-point tracers: an integer or boolean one,
    a per-call offset or a layer's positions inside a scan, stayed closed over and leaked.)"""
    closed = jax.make_jaxpr(fn)(*example)
    jaxpr, n = closed.jaxpr, len(example)

    def fn_c(*args):
        (out,) = jax.core.eval_jaxpr(jaxpr, list(args[n:]), *args[:n])
        return out

    return fn_c, tuple(closed.consts)


def differentiable(consts) -> tuple[bool, ...]:
    """Per hoisted array: whether it takes a gradient (a float array; integer and boolean
    ones get ``float0`` zeros)."""
    return tuple(jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in consts)


def floats(consts, wants):
    """The differentiable ones of ``consts`` (``wants``: ``differentiable(consts)``)."""
    return tuple(c for c, w in zip(consts, wants, strict=True) if w)


def merge(consts, floats, wants):
    """``consts`` with its differentiable entries replaced by ``floats``, in order."""
    floats = iter(floats)
    return tuple(next(floats) if w else c for c, w in zip(consts, wants, strict=True))


def no_gradient(x):
    """The zero cotangent of a non-differentiable array (``float0``), or zeros of a float."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def convert(score_mod, shape, q_rows: int = 1):
    """``(fn, consts)``: ``score_mod`` with the arrays it closes over, of any dtype, hoisted
    out as ``consts`` (``fn(score, b, h, q_idx, kv_idx, *consts)``), for logits of ``shape``
    ``[B, K, G, t, s]`` and ``q_rows`` rows of query indices (``hoist``), so a custom
    backward pass can return their gradients (``differentiable`` says which take one)."""
    example = (jnp.zeros(shape, jnp.float32),) + _examples(shape, q_rows)
    return hoist(score_mod, *example)


def at_positions(score_mod, q_pos_BT, k_pos_BS):
    """``score_mod`` seeing positions: ``q_idx`` and ``kv_idx`` index ``q_pos_BT``
    (``[B|1, T]``) and ``k_pos_BS`` (``[B|1, S]``), and the function is called with the
    positions found there (indices outside ``[0, T)`` / ``[0, S)``, a kernel's padding,
    read the nearest end). ``dot_product_attention`` wraps a score function with the
    positions of its ``MaskSpec``."""
    q_same, k_same = _counts_up(q_pos_BT), _counts_up(k_pos_BS)  # before jnp: still NumPy
    q_pos = jnp.asarray(q_pos_BT, jnp.int32)
    k_pos = jnp.asarray(k_pos_BS, jnp.int32)
    T, S = q_pos.shape[-1], k_pos.shape[-1]

    def mod(score, b, h, q_idx, kv_idx):
        # Positions that are the indices (a cache's slots 0..S-1, known while tracing) are
        # taken as they are, and one query's position is read as one entry: a kernel then
        # reads no gather of indices it would have to follow.
        if q_same:
            qp = q_idx
        elif T == 1:
            qp = q_pos[b if q_pos.shape[0] > 1 else 0, 0] + 0 * q_idx
        else:
            qp = q_pos[b if q_pos.shape[0] > 1 else 0, jnp.clip(q_idx, 0, T - 1)]
        if k_same:
            kp = kv_idx
        else:
            kp = k_pos[b if k_pos.shape[0] > 1 else 0, jnp.clip(kv_idx, 0, S - 1)]
        return score_mod(score, b, h, qp, kp)

    return mod


def _counts_up(pos) -> bool:
    """Whether ``pos`` is known while tracing and is ``0, 1, ..., n-1`` in every row."""
    try:
        a = np.asarray(pos)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return False
    return bool(np.array_equal(a, np.broadcast_to(np.arange(a.shape[-1]), a.shape)))


def with_positions(score_mod, mask):
    """``score_mod`` seeing the positions a ``MaskSpec`` gives its queries and keys
    (``at_positions``: a cache's slots, a ring's wrapped keys, a later chunk's queries), so
    every path below calls it with positions; as it is where the indices are the positions
    already (an aligned spec, an array or no mask), or where it sees them already (this
    function's result: wrapping twice would look the positions up as indices)."""
    if score_mod is None or getattr(mask, "q_pos", None) is None or mask.aligned:
        return score_mod
    if getattr(score_mod, "sees_positions", False):
        return score_mod
    mod = at_positions(score_mod, mask.q_pos, mask.k_pos)
    mod.sees_positions = True
    return mod


def apply(score_mod, score, b, h, q_idx, kv_idx):
    """``score_mod``'s logits in the dtype of ``score`` (at least float32)."""
    return score_mod(score, b, h, q_idx, kv_idx).astype(score.dtype)


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
    """ALiBi: ``s - slope_h * |q - k|``, as ``positions.alibi_bias``. ``q_idx`` and ``kv_idx``
    are the positions already (through ``dot_product_attention``); the tables ``q_pos_BT``
    / ``k_pos_BS``, read at them, serve a direct ``flex_attention`` call over arrays whose
    indices are not the positions."""
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
