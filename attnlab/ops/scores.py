"""Attention scores as a pure function: the logits a softmax attention normalises.

``attention_scores`` gives ``[B, N, T, S]`` ``scale * q.k`` (at least float32) plus the bias,
capped at ``c * tanh(s / c)`` with ``softcap``, and ``-inf`` where the mask forbids the key: the
pre-softmax logits of ``reference_attention`` (whose ``softmax`` over ``S`` gives the
weights), for inspection (``attnlab.inspect``: ``layers.{i}.attn.scores``).
"""

from __future__ import annotations

import jax.numpy as jnp

from attnlab.ops.masks import MaskSpec
from attnlab.ops.positions import PositionBias
from attnlab.ops.precision import wide


def attention_scores(q_BTNH, k_BSKH, *, mask=None, bias=None, scale=None, softcap=None):
    """``[B, N, T, S]`` pre-softmax logits (at least float32); masked keys at ``-inf`` (see above).

    ``mask`` (True: may attend) and ``bias`` broadcast to ``[B, N, T, S]``, or are a
    ``MaskSpec`` and a ``PositionBias``; query head ``n`` reads key head ``n // (N // K)``.
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    scale = H**-0.5 if scale is None else scale
    k_BSNH = jnp.repeat(k_BSKH, N // K, axis=2)
    acc = wide(q_BTNH, k_BSKH)
    logits_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH, preferred_element_type=acc) * scale
    if bias is not None:
        bias = bias.dense() if isinstance(bias, PositionBias) else bias
        logits_BNTS = logits_BNTS + jnp.broadcast_to(bias, (B, N, T, S)).astype(acc)
    if softcap is not None:
        logits_BNTS = softcap * jnp.tanh(logits_BNTS / softcap)
    if mask is not None:
        mask = mask.dense() if isinstance(mask, MaskSpec) else mask
        logits_BNTS = jnp.where(jnp.broadcast_to(mask, (B, N, T, S)), logits_BNTS, -jnp.inf)
    return logits_BNTS
