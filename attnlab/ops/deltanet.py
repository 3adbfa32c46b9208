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
the state in float32 and returns ``(o, S)``; shapes use ``attnlab.dims`` (N heads, H the
key width, J the value width, C a chunk's length, I the chunks).

The chunked form (the WY/UT transform of DeltaNet) solves each chunk's writes at once: with
``Gam[i, j] = exp(gam_i - gam_j)`` (``ops.recurrent.chunk_decays``) and ``T = I +
strict_lower(diag(beta) K K^T * Gam)``, the chunk's corrected values are ``U = T^-1 (beta
V) - T^-1 (beta K exp(gam)) S0``; then ``O = (Q exp(gam)) S0 + (Q K^T * Gam) U`` and
``S1 = exp(gam_C) S0 + (K exp(gam_C - gam))^T U``. Chunks run in sequence (a scan over
``I``), each in matrix products. With a per-channel decay the chunk's products weigh each key
channel by its own decay, ``(A K^T * Gam)[i, j] = sum_h a_i[h] k_j[h] exp(gam_i[h] -
gam_j[h])``, formed from the exact ``[C, C, H]`` decays (never a product of ``exp(gam)`` and
``exp(-gam)``, which overflows) inside the scan, so memory holds one chunk's ``B N C^2 H``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.recurrent import HIGHEST, chunk_decays, chunk_size_for, from_chunks, to_chunks

f32 = lambda x: x.astype(jnp.float32)


def _initial(state_BNHJ, B, N, H, J):
    return jnp.zeros((B, N, H, J), jnp.float32) if state_BNHJ is None else f32(state_BNHJ)


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
    S = _initial(state_BNHJ, B, N, H, v_BTNJ.shape[-1])
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


def delta_rule_chunked(
    q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN, state_BNHJ=None, *, chunk_size: int = 64
):
    """The chunked parallel form: ``(o_BTNJ, state_BNHJ)``, equal to the recurrence; ``g`` is
    ``g_BTN`` or, per key channel, ``g_BTNH``."""
    if g_BTN.ndim == k_BTNH.ndim:
        return _chunked_per_channel(
            q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN, state_BNHJ, chunk_size=chunk_size
        )
    B, T, N, H = k_BTNH.shape
    J = v_BTNJ.shape[-1]
    C = chunk_size_for(T, chunk_size)
    # [I, B, N, C, ...]: chunks first (the scan's axis), heads before the chunk's tokens.
    heads = lambda x: jnp.moveaxis(to_chunks(f32(x), C), 3, 2)
    q, k, v = heads(q_BTNH), heads(k_BTNH), heads(v_BTNJ)
    g_IBNC, beta_IBNC = heads(g_BTN), heads(beta_BTN)
    gam_IBNC, pair_IBNCC = chunk_decays(g_IBNC)
    kb = k * beta_IBNC[..., None]
    dots = lambda a, b: jnp.einsum("...iH,...jH->...ij", a, b, precision=HIGHEST)
    strict_CC = jnp.tril(jnp.ones((C, C), bool), -1)[None, None, None]
    inv_IBNCC = unit_lower_inverse(jnp.where(strict_CC, dots(kb, k) * pair_IBNCC, 0.0))
    solve = lambda b: jnp.einsum("...ij,...jX->...iX", inv_IBNCC, b, precision=HIGHEST)
    u_IBNCJ = solve(v * beta_IBNC[..., None])
    w_IBNCH = solve(kb * jnp.exp(gam_IBNC)[..., None])
    qk_IBNCC = dots(q, k) * pair_IBNCC
    q_decayed = q * jnp.exp(gam_IBNC)[..., None]
    k_decayed = k * jnp.exp(gam_IBNC[..., -1:] - gam_IBNC)[..., None]
    chunk_IBN = jnp.exp(gam_IBNC[..., -1])

    def chunk(S, x):
        u_BNCJ, w_BNCH, qk_BNCC, q_BNCH, k_BNCH, decay_BN = x
        mm = lambda eq, a, b: jnp.einsum(eq, a, b, precision=HIGHEST)
        u_BNCJ = u_BNCJ - mm("BNCH,BNHJ->BNCJ", w_BNCH, S)
        o_BNCJ = mm("BNCH,BNHJ->BNCJ", q_BNCH, S) + mm("BNCc,BNcJ->BNCJ", qk_BNCC, u_BNCJ)
        S = S * decay_BN[..., None, None] + mm("BNCH,BNCJ->BNHJ", k_BNCH, u_BNCJ)
        return S, o_BNCJ

    S = _initial(state_BNHJ, B, N, H, J)
    S, o_IBNCJ = jax.lax.scan(
        chunk, S, (u_IBNCJ, w_IBNCH, qk_IBNCC, q_decayed, k_decayed, chunk_IBN)
    )
    return from_chunks(jnp.moveaxis(o_IBNCJ, 2, 3), T), S


def _chunked_per_channel(q_BTNH, k_BTNH, v_BTNJ, g_BTNH, beta_BTN, state_BNHJ, *, chunk_size):
    """``delta_rule_chunked`` with a decay per key channel (see the module docstring)."""
    B, T, N, H = k_BTNH.shape
    J = v_BTNJ.shape[-1]
    C = chunk_size_for(T, chunk_size)
    heads = lambda x: jnp.moveaxis(to_chunks(f32(x), C), 3, 2)  # [I, B, N, C, ...]
    xs = tuple(heads(x) for x in (q_BTNH, k_BTNH, v_BTNJ, g_BTNH, beta_BTN))
    lower_11CC1 = jnp.tril(jnp.ones((C, C), bool))[None, None, :, :, None]
    strict_11CC = jnp.tril(jnp.ones((C, C), bool), -1)[None, None]
    mm = lambda eq, *a: jnp.einsum(eq, *a, precision=HIGHEST)

    def chunk(S, x):
        q, k, v, g_BNCH, beta_BNC = x
        gam_BNCH = jnp.cumsum(g_BNCH, axis=2)
        diff = gam_BNCH[:, :, :, None, :] - gam_BNCH[:, :, None, :, :]  # [B, N, C, C, H]
        pair = jnp.exp(jnp.where(lower_11CC1, diff, -jnp.inf))
        kb = k * beta_BNC[..., None]
        l_BNCC = jnp.where(strict_11CC, mm("BNiH,BNjH,BNijH->BNij", kb, k, pair), 0.0)
        inv_BNCC = unit_lower_inverse(l_BNCC)
        w_BNCH = mm("BNij,BNjH->BNiH", inv_BNCC, kb * jnp.exp(gam_BNCH))
        u_BNCJ = mm("BNij,BNjJ->BNiJ", inv_BNCC, v * beta_BNC[..., None])
        u_BNCJ = u_BNCJ - mm("BNCH,BNHJ->BNCJ", w_BNCH, S)
        qk_BNCC = mm("BNiH,BNjH,BNijH->BNij", q, k, pair)
        o_BNCJ = mm("BNCH,BNHJ->BNCJ", q * jnp.exp(gam_BNCH), S)
        o_BNCJ = o_BNCJ + mm("BNCc,BNcJ->BNCJ", qk_BNCC, u_BNCJ)
        last_BNH = gam_BNCH[:, :, -1]
        k_decayed = k * jnp.exp(last_BNH[:, :, None] - gam_BNCH)
        S = S * jnp.exp(last_BNH)[..., None] + mm("BNCH,BNCJ->BNHJ", k_decayed, u_BNCJ)
        return S, o_BNCJ

    S, o_IBNCJ = jax.lax.scan(chunk, _initial(state_BNHJ, B, N, H, J), xs)
    return from_chunks(jnp.moveaxis(o_IBNCJ, 2, 3), T), S
