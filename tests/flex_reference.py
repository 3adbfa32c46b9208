"""Float64 NumPy ground truth for flex attention: values and gradients, and the masks it is
checked with, written from the formulas (not from attnlab's mask code).

``s0 = scale q.k``, ``s1 = c tanh(s0 / c)`` (softcap ``c``), ``s2 = mod(s1)``, masked, then
``p = exp(s2) / (sum_allowed exp(s2) + exp(sink_n))`` and ``out = p v``; a row with no
allowed key has zero weights. The backward is the softmax's:
``dp = dO v^T``, ``ds2 = p (dp - rowsum(p dp))``, ``d sink = -sum p_sink rowsum(p dp)``.
"""

from __future__ import annotations

import numpy as np


def flex(q, k, v, do, *, mask=None, mod=None, softcap=None, sinks=None, scale=None):
    """``dict(out, dq, dk, dv, dsinks, ds2, s1)`` in float64; ``mod(s1) -> (s2, ds2/ds1)``
    elementwise on ``[B, N, T, S]``; ``mask`` broadcastable to ``[B, N, T, S]``."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = 1 / np.sqrt(H) if scale is None else scale
    kk, vv = np.repeat(k, G, 2), np.repeat(v, G, 2)
    s0 = np.einsum("btnh,bsnh->bnts", q, kk) * scale
    if softcap is None:
        s1, cap_grad = s0, np.ones_like(s0)
    else:
        t = np.tanh(s0 / softcap)
        s1, cap_grad = softcap * t, 1 - t**2
    s2, mod_grad = (s1, np.ones_like(s1)) if mod is None else mod(s1)
    allowed = np.broadcast_to(True if mask is None else np.asarray(mask, bool), s2.shape)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, None, None]
    m = np.where(allowed, s2, -np.inf).max(-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(s2 - m), 0.0)
    z = e.sum(-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
    p = e / np.where(z > 0, z, 1.0)
    out = np.einsum("bnts,bsnh->btnh", p, vv)
    dp = np.einsum("btnh,bsnh->bnts", do, vv)
    delta = (p * dp).sum(-1, keepdims=True)
    ds2 = p * (dp - delta)
    dsinks = None
    if sink is not None:
        p_sink = np.exp(sink - m) / np.where(z > 0, z, 1.0)
        dsinks = -(p_sink * delta).sum((0, 2, 3))
    ds0 = ds2 * mod_grad * cap_grad
    dq = np.einsum("bnts,bsnh->btnh", ds0, kk) * scale
    dkk = np.einsum("bnts,btnh->bsnh", ds0, q) * scale
    dvv = np.einsum("bnts,btnh->bsnh", p, do)
    dk = dkk.reshape(B, S, K, G, H).sum(3)
    dv = dvv.reshape(B, S, K, G, H).sum(3)
    return dict(out=out, dq=dq, dk=dk, dv=dv, dsinks=dsinks, ds2=ds2, s1=s1)


# Masks [B, 1, T, S], True = may attend, from positions t (queries) and s (keys).


def _ts(T, S):
    return np.arange(T)[:, None], np.arange(S)[None, :]


def causal(B, T, S):
    t, s = _ts(T, S)
    return np.broadcast_to(s <= t, (B, 1, T, S))


def window(B, T, S, w):
    t, s = _ts(T, S)
    return np.broadcast_to((s <= t) & (s > t - w), (B, 1, T, S))


def segments(seg_BT):
    seg = np.asarray(seg_BT)
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    return same[:, None]


def prefix_lm(prefix_B, T):
    t, s = _ts(T, T)
    return ((s <= t)[None] | (s[None] < np.asarray(prefix_B)[:, None, None]))[:, None]


def k_length(length_B, T, S):
    s = np.arange(S)[None, None, :]
    return np.broadcast_to(s < np.asarray(length_B)[:, None, None], (len(length_B), T, S))[:, None]
