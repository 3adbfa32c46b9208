"""DeepSeek Sparse Attention's key selection (DeepSeek-V3.2-Exp, 2025): the lightning
indexer's scores, the top-k keys per query, and the indexer's training objective.

The lightning indexer scores every (query t, key s) pair with a few heads ``n``::

    I[t, s] = sum_n w[t, n] * ReLU(scale * q_I[t, n] . k_I[s])

(``w`` a per-query weight of each head, ``k_I`` one key shared by the heads). Each query
keeps the ``k`` allowed keys of highest score, all of them when fewer are allowed, and the
main attention runs over the kept keys alone (a mask: ``top_k_mask``).

The indexer learns to match the main attention: its target ``p`` is the main attention's
distribution summed over the heads and L1-normalised (``attention_target``), the loss per
query ``KL(p || softmax(I))`` over a support (``indexer_kl``): every allowed key in the
dense warm-up, the kept keys in sparse training. ``[B, T, S]`` arrays are float32; a
support or a mask is boolean, True = the key counts.

Memory: the scores are ``[B, T, S]``, but the per-head products behind them (and the main
attention's ``[B, N, T, S]`` logits behind ``p``) are not kept whole: ``over_queries``
computes them for ``block_q`` queries at a time, recomputed in the backward pass.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attnlab.ops.precision import upcast, wide


def over_queries(fn, block_q: int | None, *xs_BT):
    """``fn(*xs_BT)`` computed ``block_q`` queries (axis 1 of every ``x``) at a time,
    rematerialised in the backward pass, its outputs (``[B, T, ...]`` each) joined again;
    ``fn`` may close over the keys. None, or ``T <= block_q``: one call."""
    B, T = xs_BT[0].shape[:2]
    if block_q is None or block_q >= T:
        return fn(*xs_BT)
    n = math.ceil(T / block_q)
    pad = n * block_q - T

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, block_q, *x.shape[2:]), 1, 0)

    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(split(x) for x in xs_BT))

    def join(y):
        return jnp.moveaxis(y, 0, 1).reshape(B, n * block_q, *y.shape[3:])[:, :T]

    return jax.tree.map(join, out)


def index_scores(q_BTNH, k_BSH, w_BTN, *, scale, block_q: int | None = None):
    """The indexer's scores ``I[b, t, s]`` (``[B, T, S]``, at least float32; see the module
    docstring), ``block_q`` queries at a time (``over_queries``)."""
    f32 = wide(q_BTNH, k_BSH)
    k_BSH = k_BSH.astype(f32)

    def scores(q_BTNH, w_BTN):
        dots_BTNS = jnp.einsum("BTNH,BSH->BTNS", q_BTNH.astype(f32), k_BSH) * scale
        return jnp.einsum("BTN,BTNS->BTS", w_BTN.astype(f32), jax.nn.relu(dots_BTNS))

    return over_queries(scores, block_q, q_BTNH, w_BTN)


def top_k_mask(scores_BTS, allowed_BTS, k: int):
    """True at each query's ``k`` allowed keys of highest score; every allowed key when
    fewer than ``k`` are allowed (ties: the lower key index first)."""
    S = scores_BTS.shape[-1]
    if k >= S:
        return allowed_BTS
    masked_BTS = jnp.where(allowed_BTS, scores_BTS, -jnp.inf)
    _, top_BTK = jax.lax.top_k(masked_BTS, k)
    kept_BTS = jnp.put_along_axis(
        jnp.zeros(scores_BTS.shape, bool), top_BTK, True, axis=-1, inplace=False
    )
    return kept_BTS & allowed_BTS


def attention_target(logits_BNTS, support_BTS):
    """``p``: each head's softmax over the support, summed over the heads and
    L1-normalised (``[B, T, S]``; zero rows where a query has no support)."""
    logits_BNTS = jnp.where(support_BTS[:, None], upcast(logits_BNTS), -jnp.inf)
    top_BNT1 = jnp.max(logits_BNTS, axis=-1, keepdims=True)
    e_BNTS = jnp.exp(logits_BNTS - jnp.where(jnp.isfinite(top_BNT1), top_BNT1, 0.0))
    probs_BNTS = e_BNTS / jnp.maximum(e_BNTS.sum(-1, keepdims=True), 1e-30)
    summed_BTS = probs_BNTS.sum(1)
    return summed_BTS / jnp.maximum(summed_BTS.sum(-1, keepdims=True), 1e-30)


def indexer_kl(p_BTS, scores_BTS, support_BTS):
    """``KL(p || softmax(I))`` per query over the support (``[B, T]``; 0 without
    support). ``p`` is a target: pass it with its gradient stopped."""
    scores_BTS = jnp.where(support_BTS, upcast(scores_BTS), -jnp.inf)
    lse_BT1 = jax.nn.logsumexp(scores_BTS, axis=-1, keepdims=True)
    lse_BT1 = jnp.where(jnp.isfinite(lse_BT1), lse_BT1, 0.0)
    log_q_BTS = jnp.where(support_BTS, scores_BTS - lse_BT1, 0.0)
    positive = support_BTS & (p_BTS > 0)
    log_p_BTS = jnp.log(jnp.where(positive, p_BTS, 1.0))
    return jnp.sum(jnp.where(positive, p_BTS * (log_p_BTS - log_q_BTS), 0.0), axis=-1)
