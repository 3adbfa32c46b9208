"""Attention scores as a pure function: the logits a softmax attention normalises.

``attention_scores`` gives ``[B, N, T, S]`` float32 ``scale * q.k`` plus the bias, capped at
``c * tanh(s / c)`` with ``softcap``, and ``-inf`` where the mask forbids the key: the
pre-softmax logits of ``reference_attention`` (whose ``softmax`` over ``S`` gives the
weights), for inspection (``attnlab.inspect``: ``layers.{i}.attn.scores``).
"""

from __future__ import annotations

import jax.numpy as jnp

from attnlab.ops.attention import to_BKGTS
from attnlab.ops.masks import MaskSpec
from attnlab.ops.positions import PositionBias


def attention_scores(q_BTNH, k_BSKH, *, mask=None, bias=None, scale=None, softcap=None):
    """``[B, N, T, S]`` float32 pre-softmax logits; masked keys at ``-inf`` (see above)."""
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    scale = H**-0.5 if scale is None else scale
    q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
    logits_BKGTS = (
        jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * scale
    )
    if bias is not None:
        bias = bias.dense() if isinstance(bias, PositionBias) else bias
        logits_BKGTS = logits_BKGTS + to_BKGTS(bias, B, K, G, T, S).astype(jnp.float32)
    if softcap is not None:
        logits_BKGTS = softcap * jnp.tanh(logits_BKGTS / softcap)
    if mask is not None:
        mask = mask.dense() if isinstance(mask, MaskSpec) else mask
        logits_BKGTS = jnp.where(to_BKGTS(mask, B, K, G, T, S), logits_BKGTS, -jnp.inf)
    return logits_BKGTS.reshape(B, N, T, S)
