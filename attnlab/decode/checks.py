"""Host-side input checks, run before any computation (NumPy only).

JAX gathers clamp out-of-range indices silently, so token ids are checked here, once, for
generation, recomputation, the pretrained handle and the data pipeline. Every message
names the argument, the offending value and position, and the fix.
"""

from __future__ import annotations

import numpy as np

from attnlab.config import ModelConfig
from attnlab.errors import DecodeError


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_ids(ids, vocab_size: int, name: str, *, valid=None, what: str = "vocab_size"):
    """``ids`` as a NumPy array after checking its ids lie in ``[0, vocab_size)``.

    ``valid`` (same shape, bool) limits the range check to real tokens (padding is free).
    """
    arr = np.asarray(ids)
    if arr.size and (arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer)):
        raise DecodeError(
            f"{name} must hold integer token ids, got dtype {arr.dtype}: pass integers"
        )
    bad = (arr < 0) | (arr >= vocab_size)
    if valid is not None:
        bad &= np.asarray(valid, bool)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        where = index[0] if len(index) == 1 else index
        note = "" if valid is None else " (pad positions past a row's length are not checked)"
        raise DecodeError(
            f"{name}: id {int(arr[index])} at index {where} is not a token id: it is outside "
            f"the valid range [0, {vocab_size}) of {what}={vocab_size}{note}"
        )
    return arr


def check_token(name: str, value, vocab_size: int, *, optional: bool = False):
    """A single special id (``eos_id``, ``pad_id``, ``start_id``) in ``[0, vocab_size)``."""
    if value is None and optional:
        return
    if not _is_int(value):
        raise DecodeError(f"{name}={value!r} must be an int token id")
    if not 0 <= value < vocab_size:
        raise DecodeError(f"{name}={value} is outside [0, vocab_size={vocab_size})")


def check_count(max_new_tokens) -> int:
    if not _is_int(max_new_tokens):
        raise DecodeError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    if max_new_tokens < 0:
        raise DecodeError(f"max_new_tokens={max_new_tokens} must be >= 0")
    return int(max_new_tokens)


def check_length(name: str, length: int, max_len: int, fix: str = "shorten it"):
    """A sequence the model reads must fit its ``max_len`` positions."""
    if length > max_len:
        raise DecodeError(
            f"{name} has length {length} but the model has max_len={max_len} positions "
            f"(ModelConfig.max_len): {fix}"
        )


def rows(ids, lengths, pad_id: int, name: str, vocab_size: int | None):
    """A right-padded ``[B, P]`` int array and ``[B]`` lengths from an array or lists,
    with every id before a row's length checked against ``vocab_size`` (unless None)."""
    if isinstance(ids, list | tuple) and all(np.ndim(r) >= 1 for r in ids):
        rows_ = [np.asarray(r).reshape(-1) for r in ids]
        default_lengths = np.array([len(r) for r in rows_], np.int64)
        out = np.full((len(rows_), max([len(r) for r in rows_], default=0)), pad_id, np.int64)
        for b, r in enumerate(rows_):
            if r.size and not np.issubdtype(r.dtype, np.integer):
                raise DecodeError(f"{name}[{b}] must hold integer token ids, got dtype {r.dtype}")
            out[b, : len(r)] = r
    else:
        out = np.asarray(ids)
        if out.ndim != 2:
            raise DecodeError(
                f"{name} must be 2-D [batch, length] (or a list of lists), got shape "
                f"{out.shape}; use ids[None] for one sequence"
            )
        check_ids(out[:, :0], 1, name)  # the dtype
        default_lengths = np.full((out.shape[0],), out.shape[1], np.int64)
    if out.shape[0] == 0:
        raise DecodeError(f"{name} has no rows")
    lengths = default_lengths if lengths is None else np.asarray(lengths).astype(np.int64)
    if lengths.shape != (out.shape[0],):
        raise DecodeError(f"{name} lengths must have shape [{out.shape[0]}], got {lengths.shape}")
    bad = np.flatnonzero((lengths < 0) | (lengths > out.shape[1]))
    if bad.size:
        b = int(bad[0])
        raise DecodeError(f"row {b} of {name} has length {lengths[b]}, outside [0, {out.shape[1]}]")
    if vocab_size is not None:
        valid = np.arange(out.shape[1])[None, :] < lengths[:, None]
        check_ids(out, vocab_size, name, valid=valid)
    return out, lengths


def capacity(cfg: ModelConfig, max_len) -> int:
    """The cache capacity: the positions a row may reach, ``max_len``, default
    ``ModelConfig.max_len``. A ring-buffer cache serves them with only its window's slots,
    so a sliding-window model generates past its window up to this limit."""
    if max_len is None:
        return cfg.max_len
    if not _is_int(max_len) or max_len < 1:
        raise DecodeError(f"max_len={max_len!r} must be a positive int (the cache capacity)")
    if max_len > cfg.max_len:
        raise DecodeError(
            f"max_len={max_len} exceeds ModelConfig.max_len={cfg.max_len}: the model has no "
            "positions beyond it; pass max_len <= ModelConfig.max_len"
        )
    return int(max_len)


def check_fits(what: str, used: int, n: int, cfg: ModelConfig, max_len, *, stop_hint: bool):
    """The cache capacity, after checking ``used`` tokens + ``n`` new ones fit it; the
    message names the ways out (``stop_hint``: ``on_overflow='stop'`` is one)."""
    cap = capacity(cfg, max_len)
    if max_len is None:
        bound, larger = f"ModelConfig.max_len={cfg.max_len}", ""
    else:
        bound = f"the cache capacity max_len={cap}"
        larger = "" if cap == cfg.max_len else f", raise max_len (up to {cfg.max_len})"
    if used > cap:
        raise DecodeError(f"{what} alone exceeds {bound}: shorten it{larger}")
    if used + n > cap:
        stop = ", or pass on_overflow='stop' to stop rows at capacity" if stop_hint else ""
        raise DecodeError(
            f"{what} + max_new_tokens {n} = {used + n} exceeds {bound}: shorten the input, "
            f"lower max_new_tokens{larger}{stop}"
        )
    return cap


def checked_jit(fn, *, jit=None, **jit_options):
    """``fn`` jitted (``jax.jit``, or ``jit=nnx.jit`` for a function of NNX modules) with
    the checks the model makes on traced values raising after each call, as eager calls do.

    Under ``jit`` a model cannot raise on what it only sees traced: a write past a linear
    cache's capacity (``kv_cache.check_capacity``) and a position past an absolute position
    table (``nn.stack.check_positions``). Traced here, they are ``jax.experimental.checkify``
    checks (``attnlab.errors.traced_check``; a plain jit traces none of them), so such a call
    raises a ``DecodeError`` naming the capacity or the table and the fix, instead of
    returning wrong or NaN logits. A hand-written decoding loop:

        step = checked_jit(lambda model, ids, cache: model(ids, cache=cache), jit=nnx.jit)

    Each call reads the error flag back (one small device-to-host copy):
    ``benchmarks/runtime_checks.py`` measures what that costs per decoding step.
    """
    import functools

    import jax
    from jax.experimental import checkify

    from attnlab.errors import traced_checks

    def inner(*args, **kwargs):
        body = functools.partial(fn, *args, **kwargs)  # its arguments closed over
        with traced_checks():
            return checkify.checkify(body, errors=checkify.user_checks)()

    compiled = (jit or jax.jit)(inner, **jit_options)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        error, out = compiled(*args, **kwargs)
        message = error.get()
        if message is not None:
            raise DecodeError(message.replace(" (`check` failed)", ""))
        return out

    return call
