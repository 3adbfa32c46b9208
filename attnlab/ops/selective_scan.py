"""Mamba-1's selective scan (Gu and Dao 2023, "Mamba", Algorithm 2), per channel ``z`` of the
inner width ``Z`` and state entry ``j`` of ``J``::

    h_t[z, j] = exp(dt_t[z] A[z, j]) h_{t-1}[z, j] + dt_t[z] x_t[z] B_t[j]
    y_t[z] = sum_j h_t[z, j] C_t[j]

``A`` is ``[Z, J]`` (one decay per channel and state entry), ``dt`` ``[B, T, Z]`` (after the
softplus), ``B`` and ``C`` ``[B, T, J]`` (shared by the channels). A token with ``dt = 0``
leaves the state as it was. Three forms, equal up to rounding: ``selective_scan_recurrent``
(one step per token, ``lax.scan``), ``selective_scan_chunked`` (an associative scan inside
each chunk of ``chunk_size`` tokens, the state carried between chunks) and
``selective_scan_step`` (one token, for decoding). All compute in at least float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.precision import upcast, wide


def _terms(x_BTZ, dt_BTZ, A_ZJ, B_BTJ):
    """The recurrence's per-token decay ``a`` and input ``b``, both ``[B, T, Z, J]``."""
    f = upcast
    dt = f(dt_BTZ)
    a_BTZJ = jnp.exp(dt[..., None] * f(A_ZJ)[None, None])
    b_BTZJ = (dt * f(x_BTZ))[..., None] * f(B_BTJ)[:, :, None, :]
    return a_BTZJ, b_BTZJ


def selective_scan_step(x_BZ, dt_BZ, A_ZJ, B_BJ, C_BJ, state_BZJ):
    """One token: ``(y_BZ, state_BZJ)``."""
    a, b = _terms(x_BZ[:, None], dt_BZ[:, None], A_ZJ, B_BJ[:, None])
    state = a[:, 0] * upcast(state_BZJ) + b[:, 0]
    return jnp.einsum("BZJ,BJ->BZ", state, upcast(C_BJ)), state


def selective_scan_recurrent(x_BTZ, dt_BTZ, A_ZJ, B_BTJ, C_BTJ, state_BZJ=None):
    """Token by token: ``(y_BTZ, state_BZJ)``; ``state`` zeros when None."""
    Bsz, _, Z = x_BTZ.shape
    J = A_ZJ.shape[-1]
    if state_BZJ is None:
        state_BZJ = jnp.zeros((Bsz, Z, J), wide(x_BTZ, dt_BTZ))

    def step(state, xs):
        x, dt, b, c = xs
        y, state = selective_scan_step(x, dt, A_ZJ, b, c, state)
        return state, y

    xs = tuple(jnp.moveaxis(v, 1, 0) for v in (x_BTZ, dt_BTZ, B_BTJ, C_BTJ))
    state, y_TBZ = jax.lax.scan(step, upcast(state_BZJ), xs)
    return jnp.moveaxis(y_TBZ, 0, 1), state


def selective_scan_chunked(x_BTZ, dt_BTZ, A_ZJ, B_BTJ, C_BTJ, state_BZJ=None, *, chunk_size=64):
    """Chunk by chunk (an associative scan inside each): ``(y_BTZ, state_BZJ)``."""
    Bsz, T, Z = x_BTZ.shape
    J = A_ZJ.shape[-1]
    if state_BZJ is None:
        state_BZJ = jnp.zeros((Bsz, Z, J), wide(x_BTZ, dt_BTZ))
    Q = min(chunk_size, T)
    pad = -T % Q
    padded = lambda v: jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
    x, dt, Bm, Cm = (padded(v) for v in (x_BTZ, dt_BTZ, B_BTJ, C_BTJ))  # dt 0: no change
    chunks = lambda v: jnp.moveaxis(v.reshape(Bsz, -1, Q, *v.shape[2:]), 1, 0)

    def combine(first, second):
        a1, b1 = first
        a2, b2 = second
        return a1 * a2, a2 * b1 + b2

    def chunk(state, xs):
        x, dt, b, c = xs
        a_BCZJ, u_BCZJ = _terms(x, dt, A_ZJ, b)
        decay_BCZJ, h_BCZJ = jax.lax.associative_scan(combine, (a_BCZJ, u_BCZJ), axis=1)
        h_BCZJ = h_BCZJ + decay_BCZJ * state[:, None]
        return h_BCZJ[:, -1], jnp.einsum("BCZJ,BCJ->BCZ", h_BCZJ, upcast(c))

    state, y = jax.lax.scan(chunk, upcast(state_BZJ), tuple(map(chunks, (x, dt, Bm, Cm))))
    return jnp.moveaxis(y, 0, 1).reshape(Bsz, -1, Z)[:, :T], state
