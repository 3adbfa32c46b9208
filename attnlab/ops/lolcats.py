"""LoLCATs attention (Zhang et al. 2024): softmax over a sliding window of the last ``W``
tokens plus linear attention with a learned feature map over every older token, mixed by a
learned factor ``g`` per head. For query ``t`` and keys ``s <= t`` (``d = t - s``)::

    a_ts = g exp(q_t . k_s * scale - m_t)      d < W   (m_t: the max over the window)
    b_ts = (1 - g) phi_q(q_t) . phi_k(k_s)     d >= W
    y_t  = sum_s (a_ts + b_ts) v_s / sum_s (a_ts + b_ts)

``phi(x) = [softmax(x W_f), softmax(-x W_f)]`` over the ``F`` features (the Hedgehog map
LoLCATs learns; ``2F`` features out). ``W = 0`` is plain linear attention with the learned
map. Query ``t``'s own key is always in its window (or, with ``W = 0``, in its linear part),
so no row is empty.

Decoding keeps the last ``W`` keys and values (a window that rolls by one token per step)
and, for the tokens that left it, ``S = sum phi_k(k) v^T`` (``[N, 2F, H]``) and ``z = sum
phi_k(k)`` (``[N, 2F]``). ``attend`` takes those (or None) with keys laid out as the window
then the call's tokens, so one function is the training pass, a prefill and a decode step.
Everything is computed in at least float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.precision import upcast


def feature_map(x_BTNH, w_NHF):
    """``[softmax(x W), softmax(-x W)]`` per head over the features: ``[B, T, N, 2F]``."""
    u_BTNF = jnp.einsum("BTNH,NHF->BTNF", upcast(x_BTNH), upcast(w_NHF))
    return jnp.concatenate([jax.nn.softmax(u_BTNF, -1), jax.nn.softmax(-u_BTNF, -1)], -1)


def attend(q_BTNH, k_BSNH, v_BSNH, fq_BTNF, fk_BSNF, g_N, *, window: int, scale: float,
           q_index_T, valid_BS=None, state=None):  # fmt: skip
    """``y_BTNH`` of the equations above. Keys ``s`` sit at index ``s`` of the S axis and
    query ``t`` at ``q_index_T[t]`` of the same axis; ``valid_BS`` marks real keys (None:
    all); ``state = (S_BNFH, z_BNF)`` holds the keys older than every key here (None:
    none). Heads of k and v are already those of q (repeated for GQA)."""
    S = k_BSNH.shape[1]
    d_TS = q_index_T[:, None] - jnp.arange(S)[None, :]
    keep_BTS = (d_TS >= 0)[None]
    if valid_BS is not None:
        keep_BTS = keep_BTS & valid_BS[:, None, :]
    win_B1TS = (keep_BTS & (d_TS < window)[None])[:, None]
    lin_B1TS = (keep_BTS & (d_TS >= window)[None])[:, None]
    g_1N11 = upcast(g_N)[None, :, None, None]
    q, k, v = upcast(q_BTNH), upcast(k_BSNH), upcast(v_BSNH)
    s_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q, k) * scale
    s_BNTS = jnp.where(win_B1TS, s_BNTS, -jnp.inf)
    m_BNT1 = jnp.max(s_BNTS, axis=-1, keepdims=True)
    m_BNT1 = jnp.where(jnp.isfinite(m_BNT1), m_BNT1, 0.0)
    a_BNTS = jnp.where(win_B1TS, jnp.exp(s_BNTS - m_BNT1), 0.0) * g_1N11
    b_BNTS = jnp.einsum("BTNF,BSNF->BNTS", fq_BTNF, fk_BSNF)
    b_BNTS = jnp.where(lin_B1TS, b_BNTS, 0.0) * (1.0 - g_1N11)
    w_BNTS = a_BNTS + b_BNTS
    num_BTNH = jnp.einsum("BNTS,BSNH->BTNH", w_BNTS, v)
    den_BTN = jnp.einsum("BNTS->BTN", w_BNTS)
    if state is not None:
        S_BNFH, z_BNF = (upcast(x) for x in state)
        lin_111N = (1.0 - upcast(g_N))[None, None, :]
        num_BTNH = num_BTNH + jnp.einsum("BTNF,BNFH->BTNH", fq_BTNF, S_BNFH) * lin_111N[..., None]
        den_BTN = den_BTN + jnp.einsum("BTNF,BNF->BTN", fq_BTNF, z_BNF) * lin_111N
    return num_BTNH / jnp.maximum(den_BTN, 1e-30)[..., None]


def absorb(state, fk_BSNF, v_BSNH, leave_BS):
    """``(S, z)`` with the keys marked by ``leave_BS`` (those leaving the window) added."""
    S_BNFH, z_BNF = state
    w_BS = leave_BS.astype(jnp.float32)
    S_BNFH = S_BNFH + jnp.einsum("BSNF,BSNH,BS->BNFH", fk_BSNF, upcast(v_BSNH), w_BS)
    z_BNF = z_BNF + jnp.einsum("BSNF,BS->BNF", fk_BSNF, w_BS)
    return S_BNFH, z_BNF


def roll_window(x_BSKH, count_B, window: int):
    """The last ``window`` of each row's first ``window + count_B`` entries of ``x``
    (the old window, then the call's real tokens): ``[B, window, K, H]``."""
    take = lambda x_SKH, c: jax.lax.dynamic_slice_in_dim(x_SKH, c, window, axis=0)
    return jax.vmap(take)(x_BSKH, count_B)
