"""Mamba-2's selective state space in its state-space-duality form (SSD, "Transformers are
SSMs", Dao and Gu 2024), in three forms: a one-token step, the per-token recurrence
(``lax.scan``, the reference) and the chunked parallel form (training and prefill).

Per head, with the state ``h`` a ``[H, J]`` matrix (head width H, state size J), a
step ``dt_t > 0`` (after softplus), ``A < 0`` the head's decay rate, input ``x_t`` ``[H]``,
``B_t`` and ``C_t`` ``[J]`` (each shared by the heads of its group; the caller expands
them to heads)::

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T
    y_t = h_t C_t                   (the module adds the skip D x_t)

A token with ``dt = 0`` leaves ``h`` as it was (padding). The state is at least float32 throughout;
each form returns ``(y_BTNH, state_BNHJ)``.

The chunked form: with the log-decay ``a = dt A``, its cumulative sum ``gam`` within a chunk
and ``Gam[i, j] = exp(gam_i - gam_j)`` (``i >= j``), ``Y = (C B^T * Gam)(dt X) + exp(gam)
C h0^T`` and ``h1 = exp(gam_C) h0 + sum_j exp(gam_C - gam_j) dt_j x_j B_j^T``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.precision import upcast, wide
from attnlab.ops.recurrent import HIGHEST, chunk_decays, chunk_size_for, from_chunks, to_chunks

f32 = upcast  # at least float32: float64 inputs stay float64


def _initial(state_BNHJ, B, N, H, J, dtype):
    return jnp.zeros((B, N, H, J), dtype) if state_BNHJ is None else f32(state_BNHJ)


def ssd_step(x_BNH, dt_BN, A_N, B_BNJ, C_BNJ, state_BNHJ):
    """One token of the selective state space: ``(y_BNH, state_BNHJ)``."""
    x_BNH, dt_BN, A_N, B_BNJ, C_BNJ = map(f32, (x_BNH, dt_BN, A_N, B_BNJ, C_BNJ))
    decay_BN = jnp.exp(dt_BN * A_N[None, :])
    write_BNH = x_BNH * dt_BN[..., None]
    S = f32(state_BNHJ) * decay_BN[..., None, None] + write_BNH[..., :, None] * B_BNJ[..., None, :]
    return jnp.einsum("BNHJ,BNJ->BNH", S, C_BNJ, precision=HIGHEST), S


def ssd_recurrent(x_BTNH, dt_BTN, A_N, B_BTNJ, C_BTNJ, state_BNHJ=None):
    """The per-token recurrence (the reference form): ``(y_BTNH, state_BNHJ)``."""
    B, _, N, H = x_BTNH.shape
    S = _initial(state_BNHJ, B, N, H, B_BTNJ.shape[-1], wide(x_BTNH))
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (x_BTNH, dt_BTN, B_BTNJ, C_BTNJ))

    def step(S, x):
        x_BNH, dt_BN, B_BNJ, C_BNJ = x
        y_BNH, S = ssd_step(x_BNH, dt_BN, A_N, B_BNJ, C_BNJ, S)
        return S, y_BNH

    S, y_TBNH = jax.lax.scan(step, S, xs)
    return jnp.moveaxis(y_TBNH, 0, 1), S


def ssd_chunked(x_BTNH, dt_BTN, A_N, B_BTNJ, C_BTNJ, state_BNHJ=None, *, chunk_size: int = 64):
    """The chunked parallel form: ``(y_BTNH, state_BNHJ)``, equal to the recurrence."""
    B, T, N, H = x_BTNH.shape
    J = B_BTNJ.shape[-1]
    C = chunk_size_for(T, chunk_size)
    heads = lambda x: jnp.moveaxis(to_chunks(f32(x), C), 3, 2)  # [I, B, N, C, ...]
    dt_IBNC = heads(dt_BTN)
    x_IBNCH = heads(x_BTNH) * dt_IBNC[..., None]  # the writes, dt x
    b_IBNCJ, c_IBNCJ = heads(B_BTNJ), heads(C_BTNJ)
    gam_IBNC, pair_IBNCC = chunk_decays(dt_IBNC * f32(A_N)[None, None, :, None])
    mm = lambda eq, a, b: jnp.einsum(eq, a, b, precision=HIGHEST)
    scores_IBNCC = mm("...iJ,...jJ->...ij", c_IBNCJ, b_IBNCJ) * pair_IBNCC
    y_diag_IBNCH = mm("...ij,...jH->...iH", scores_IBNCC, x_IBNCH)
    c_decayed = c_IBNCJ * jnp.exp(gam_IBNC)[..., None]
    b_decayed = b_IBNCJ * jnp.exp(gam_IBNC[..., -1:] - gam_IBNC)[..., None]
    chunk_IBN = jnp.exp(gam_IBNC[..., -1])

    def chunk(S, xs):
        c_BNCJ, b_BNCJ, x_BNCH, decay_BN = xs
        y_BNCH = mm("BNCJ,BNHJ->BNCH", c_BNCJ, S)
        S = S * decay_BN[..., None, None] + mm("BNCH,BNCJ->BNHJ", x_BNCH, b_BNCJ)
        return S, y_BNCH

    S = _initial(state_BNHJ, B, N, H, J, wide(x_BTNH))
    S, y_off_IBNCH = jax.lax.scan(chunk, S, (c_decayed, b_decayed, x_IBNCH, chunk_IBN))
    return from_chunks(jnp.moveaxis(y_diag_IBNCH + y_off_IBNCH, 2, 3), T), S
