"""The gated delta rule ("Gated Delta Networks", Yang et al. 2024; Qwen3-Next's linear
attention) in three forms: a one-token step, the per-token recurrence (``lax.scan``, the
reference) and the chunked parallel form (training and prefill).

Per head, with the state ``S`` a ``[H, J]`` matrix (key width H, value width J), an
L2-normalised key ``k_t``, a query ``q_t`` (L2-normalised and scaled by ``H ** -0.5`` by
the caller), a value ``v_t``, a log-decay ``g_t <= 0`` and a write strength ``beta_t``::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t

The decay is per head (``g_BTN``: Gated DeltaNet) or per key channel (``g_BTNH``: Kimi Delta
Attention, "Kimi Linear", Moonshot AI 2025), where ``exp(g_t)`` becomes ``Diag(exp(g_t))``
acting on the state's key rows::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T

A token with ``g = 0`` and ``beta = 0`` leaves ``S`` as it was (padding). Every form keeps
the state in at least float32 and returns ``(o, S)``; shapes use ``attnlab.dims`` (N heads, H the
key width, J the value width, C a chunk's length, I the chunks).

The chunked form (the WY/UT transform of DeltaNet) solves each chunk's writes at once: with
``Gam[i, j] = exp(gam_i - gam_j)`` (``ops.recurrent.chunk_decays``) and ``T = I +
strict_lower(diag(beta) K K^T * Gam)``, the chunk's corrected values are ``U = T^-1 (beta
V) - T^-1 (beta K exp(gam)) S0``; then ``O = (Q exp(gam)) S0 + (Q K^T * Gam) U`` and
``S1 = exp(gam_C) S0 + (K exp(gam_C - gam))^T U``. Chunks run in sequence (a scan over
``I``), each in matrix products. With a per-channel decay the chunk's products weigh each key
channel by its own decay, ``(A K^T * Gam)[i, j] = sum_h a_i[h] k_j[h] exp(gam_i[h] -
gam_j[h])``, never a product of ``exp(gam)`` and ``exp(-gam)``, which overflows: within
sub-chunks of 16 tokens from the exact ``[16, 16, H]`` decays, across them through the first
token of the row's sub-chunk (``_channel_dots``), one chunk at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.precision import upcast, wide
from attnlab.ops.recurrent import HIGHEST, chunk_decays, chunk_size_for, from_chunks, to_chunks

f32 = upcast  # at least float32: float64 inputs stay float64


def _initial(state_BNHJ, B, N, H, J, dtype):
    return jnp.zeros((B, N, H, J), dtype) if state_BNHJ is None else f32(state_BNHJ)


def _state_decay(g, k):
    """``exp(g)`` shaped to multiply a ``[..., H, J]`` state: per head (``g`` one axis short
    of ``k``) or per key channel (``g`` shaped as ``k``)."""
    decay = jnp.exp(f32(g))
    return decay[..., None] if g.ndim == k.ndim else decay[..., None, None]


def delta_rule_step(q_BNH, k_BNH, v_BNJ, g_BN, beta_BN, state_BNHJ):
    """One token of the gated delta rule: ``(o_BNJ, state_BNHJ)``; ``g`` is ``g_BN`` or,
    per key channel, ``g_BNH``."""
    q_BNH, k_BNH, v_BNJ, g_BN, beta_BN = map(f32, (q_BNH, k_BNH, v_BNJ, g_BN, beta_BN))
    S = f32(state_BNHJ) * _state_decay(g_BN, k_BNH)
    kv_BNJ = jnp.einsum("BNHJ,BNH->BNJ", S, k_BNH, precision=HIGHEST)
    delta_BNJ = (v_BNJ - kv_BNJ) * beta_BN[..., None]
    S = S + k_BNH[..., :, None] * delta_BNJ[..., None, :]
    return jnp.einsum("BNHJ,BNH->BNJ", S, q_BNH, precision=HIGHEST), S


def delta_rule_recurrent(q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN, state_BNHJ=None):
    """The per-token recurrence (the reference form): ``(o_BTNJ, state_BNHJ)``."""
    B, _, N, H = k_BTNH.shape
    S = _initial(state_BNHJ, B, N, H, v_BTNJ.shape[-1], wide(v_BTNJ))
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN))

    def step(S, x):
        o_BNJ, S = delta_rule_step(*x, S)
        return S, o_BNJ

    S, o_TBNJ = jax.lax.scan(step, S, xs)
    return jnp.moveaxis(o_TBNJ, 0, 1), S


@jax.custom_vjp
def unit_lower_inverse(l_XCC):
    """``(I + L)^-1`` for strictly lower-triangular ``L`` (the last two axes), by forward
    substitution: row ``i`` of the inverse is ``e_i - L[i] @ inv``, the rows above it being
    final, one batched matrix-vector product per row over every matrix at once.

    Not ``solve_triangular``: XLA:CPU runs it as one LAPACK call per matrix over its thread
    pool (seconds at training shapes, and it could deadlock the pool). Not repeated squaring
    (``(I - N)^-1 = (I + N)(I + N^2)(I + N^4)...``): with a run of equal keys (filler tokens)
    ``L`` is near a strictly lower matrix of ones, whose powers reach binomial sizes
    (``C(63, 31) ~ 1e18`` at 64 tokens), and float32 loses the result in their
    cancellation. The gradient is the inverse's own, ``-inv^T g inv^T`` on the strict lower
    triangle.
    """
    C = l_XCC.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(C, dtype=l_XCC.dtype), l_XCC.shape)

    def row(i, inv_XCC):
        l_XC = jax.lax.dynamic_index_in_dim(l_XCC, i, axis=-2, keepdims=False)
        done = jnp.einsum("...j,...jk->...k", l_XC, inv_XCC, precision=HIGHEST)
        e_XC = jax.lax.dynamic_index_in_dim(eye, i, axis=-2, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(inv_XCC, e_XC - done, i, axis=-2)

    return jax.lax.fori_loop(1, C, row, eye)


def _inverse_fwd(l_XCC):
    inv = unit_lower_inverse(l_XCC)
    return inv, inv


def _inverse_bwd(inv_XCC, g_XCC):
    t = lambda x: jnp.swapaxes(x, -1, -2)
    mm = lambda a, b: jnp.einsum("...ij,...jk->...ik", a, b, precision=HIGHEST)
    strict = jnp.tril(jnp.ones(inv_XCC.shape[-2:], bool), -1)
    return (jnp.where(strict, -mm(mm(t(inv_XCC), g_XCC), t(inv_XCC)), 0.0),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def _channel_dots(a_BNCH, k_BNCH, gam_BNCH, sub: int):
    """One chunk's ``sum_h a_i[h] k_j[h] exp(gam_i[h] - gam_j[h])`` for ``i >= j`` (0 above
    the diagonal). Within each sub-chunk of ``sub`` tokens, from the exact ``[sub, sub, H]``
    decays; across sub-chunks, as matrix products through the first token ``r`` of row
    ``i``'s sub-chunk, ``exp(gam_i - gam_r) exp(gam_r - gam_j)``, both factors at most 1."""
    B, N, C, H = k_BNCH.shape
    A = C // sub
    mm = lambda eq, x, y: jnp.einsum(eq, x, y, precision=HIGHEST)
    blocks = lambda x: x.reshape(B, N, A, sub, H)
    gam_BNASH = blocks(gam_BNCH)
    ref_BNA1H = gam_BNASH[:, :, :, :1]
    left_BNASH = blocks(a_BNCH) * jnp.exp(gam_BNASH - ref_BNA1H)
    # Column j < r of row block a: exp(gam_r - gam_j); later columns masked before the exp.
    before_11AC1 = (jnp.arange(C)[None, :] < sub * jnp.arange(A)[:, None])[None, None, :, :, None]
    rise = jnp.where(before_11AC1, ref_BNA1H - gam_BNCH[:, :, None], -jnp.inf)
    right_BNACH = k_BNCH[:, :, None] * jnp.exp(rise)
    across_BNASC = mm("BNAiH,BNAjH->BNAij", left_BNASH, right_BNACH)
    diff = gam_BNASH[:, :, :, :, None, :] - gam_BNASH[:, :, :, None, :, :]
    lower_111SS1 = jnp.tril(jnp.ones((sub, sub), bool))[None, None, None, :, :, None]
    pair = jnp.exp(jnp.where(lower_111SS1, diff, -jnp.inf))
    within_BNASS = jnp.einsum(
        "BNAiH,BNAjH,BNAijH->BNAij", blocks(a_BNCH), blocks(k_BNCH), pair, precision=HIGHEST
    )
    own_11A1C = (jnp.arange(C)[None, :] // sub == jnp.arange(A)[:, None])[None, None, :, None, :]
    diagonal = jnp.where(own_11A1C, jnp.tile(within_BNASS, (1, 1, 1, 1, A)), 0.0)
    return (across_BNASC + diagonal).reshape(B, N, C, C)


def delta_rule_chunked(
    q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN, state_BNHJ=None, *, chunk_size: int = 64
):
    """The chunked parallel form: ``(o_BTNJ, state_BNHJ)``, equal to the recurrence; ``g`` is
    ``g_BTN`` or, per key channel, ``g_BTNH``."""
    B, T, N, H = k_BTNH.shape
    J = v_BTNJ.shape[-1]
    C = chunk_size_for(T, chunk_size)
    # [I, B, N, C, ...]: chunks first (the scan's axis), heads before the chunk's tokens.
    heads = lambda x: jnp.moveaxis(to_chunks(f32(x), C), 3, 2)
    q, k, v = heads(q_BTNH), heads(k_BTNH), heads(v_BTNJ)
    g, beta_IBNC = heads(g_BTN), heads(beta_BTN)
    kb = k * beta_IBNC[..., None]
    dots = lambda a, b: jnp.einsum("...iH,...jH->...ij", a, b, precision=HIGHEST)
    if g.ndim == k.ndim:  # per key channel: gam [I, B, N, C, H], one chunk's pairs at a time
        gam = jnp.cumsum(g, axis=-2)
        sub = min(C, 16)
        pairs = lambda x: tuple(_channel_dots(y, x[2], x[3], sub) for y in x[:2])
        l_IBNCC, qk_IBNCC = jax.lax.map(pairs, (kb, q, k, gam))
        decay_q, decay_k = jnp.exp(gam), jnp.exp(gam[..., -1:, :] - gam)
        chunk_decay = jnp.exp(gam[..., -1, :])  # [I, B, N, H]
    else:  # per head: gam [I, B, N, C]
        gam, pair_IBNCC = chunk_decays(g)
        l_IBNCC, qk_IBNCC = dots(kb, k) * pair_IBNCC, dots(q, k) * pair_IBNCC
        decay_q, decay_k = jnp.exp(gam)[..., None], jnp.exp(gam[..., -1:] - gam)[..., None]
        chunk_decay = jnp.exp(gam[..., -1])  # [I, B, N]
    strict_CC = jnp.tril(jnp.ones((C, C), bool), -1)[None, None, None]
    inv_IBNCC = unit_lower_inverse(jnp.where(strict_CC, l_IBNCC, 0.0))
    solve = lambda b: jnp.einsum("...ij,...jX->...iX", inv_IBNCC, b, precision=HIGHEST)
    u_IBNCJ = solve(v * beta_IBNC[..., None])
    w_IBNCH = solve(kb * decay_q)

    def chunk(S, x):
        u_BNCJ, w_BNCH, qk_BNCC, q_BNCH, k_BNCH, decay = x
        mm = lambda eq, a, b: jnp.einsum(eq, a, b, precision=HIGHEST)
        u_BNCJ = u_BNCJ - mm("BNCH,BNHJ->BNCJ", w_BNCH, S)
        o_BNCJ = mm("BNCH,BNHJ->BNCJ", q_BNCH, S) + mm("BNCc,BNcJ->BNCJ", qk_BNCC, u_BNCJ)
        by_key = decay[..., None] if decay.ndim == 3 else decay[..., None, None]  # BNH / BN
        S = S * by_key + mm("BNCH,BNCJ->BNHJ", k_BNCH, u_BNCJ)
        return S, o_BNCJ

    S = _initial(state_BNHJ, B, N, H, J, wide(v_BTNJ))
    S, o_IBNCJ = jax.lax.scan(
        chunk, S, (u_IBNCJ, w_IBNCH, qk_IBNCC, q * decay_q, k * decay_k, chunk_decay)
    )
    return from_chunks(jnp.moveaxis(o_IBNCJ, 2, 3), T), S


def delta_rule(q_BTNH, k_BTNH, v_BTNJ, g, beta_BTN, state_BNHJ, *, step, form, chunk_size):
    """The delta rule in the form a call needs: one decode step (``step``: T = 1 with a
    cache), the per-token recurrence (``form="recurrent"``) or the chunked form; ``g`` is the
    log decay per head (``[B, T, N]``) or per key channel (``[B, T, N, H]``). Returns the
    outputs ``[B, T, N, J]`` and the final state."""
    args = (q_BTNH, k_BTNH, v_BTNJ, g, beta_BTN)
    if step:
        o_BNJ, state = delta_rule_step(*(a[:, 0] for a in args), state_BNHJ)
        return o_BNJ[:, None], state
    if form == "recurrent":
        return delta_rule_recurrent(*args, state_BNHJ)
    return delta_rule_chunked(*args, state_BNHJ, chunk_size=chunk_size)
