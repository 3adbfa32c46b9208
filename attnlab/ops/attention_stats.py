"""Per-layer statistics of a softmax attention's scores, reduced where they are computed.

``attention_statistics`` takes a layer's queries and keys (after QK-norm and RoPE), the
mask and the bias descriptions, the logit scale, cap and sinks the layer attends with, and
returns scalars only: no ``[T, S]`` array leaves the layer. It serves the training-health
metrics (``attnlab.metrics``):

* ``max_logit``: the largest scaled ``q . k`` over allowed (query, key) pairs, before any
  cap or bias (the quantity a QK weight-norm product bounds), over batch and heads;
* ``entropy_sum``: the sum over rows (batch x heads x queries with an allowed key) of the
  softmax entropy ``-sum_s p log p`` in nats (a sink takes its share of the mass);
* ``first_sum``: the sum over the same rows of the weight on the row's first key (index 0);
* ``rows``: the number of those rows, so micro-batches and devices add before dividing.

The scores are built densely per layer: ``B x N x T x S`` float32 values live inside the
layer while it runs (on the chunked path too), which is the metric's memory cost.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _dense(x, B, N, T, S):
    """A mask or bias description (or array) broadcast to ``[B, N, T, S]``."""
    if x is None:
        return None
    if hasattr(x, "dense"):
        x = x.dense()
    return jnp.broadcast_to(jnp.asarray(x), (B, N, T, S))


def attention_statistics(
    q_BTNH, k_BSKH, *, mask=None, bias=None, scale, softcap=None, sinks_N=None
) -> dict:
    """``{"max_logit", "entropy_sum", "first_sum", "rows"}`` (float32 scalars); see the
    module docstring. Query head ``n`` reads key head ``n // (N // K)``."""
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    k_BSNH = jnp.repeat(k_BSKH, N // K, axis=2)
    f32 = jnp.float32
    logits_BNTS = jnp.einsum(
        "BTNH,BSNH->BNTS", q_BTNH.astype(f32), k_BSNH.astype(f32), preferred_element_type=f32
    ) * jnp.asarray(scale, f32)
    allowed_BNTS = _dense(mask, B, N, T, S)
    allowed_BNTS = (
        jnp.ones((B, N, T, S), bool) if allowed_BNTS is None else allowed_BNTS.astype(bool)
    )
    max_logit = jnp.max(jnp.where(allowed_BNTS, logits_BNTS, -jnp.inf))
    z_BNTS = logits_BNTS
    if bias is not None:
        z_BNTS = z_BNTS + _dense(bias, B, N, T, S).astype(f32)
    if softcap is not None:
        z_BNTS = softcap * jnp.tanh(z_BNTS / softcap)
    z_BNTS = jnp.where(allowed_BNTS, z_BNTS, -jnp.inf)
    top_BNT = jnp.max(z_BNTS, axis=-1)
    if sinks_N is not None:
        sink_BNT = jnp.broadcast_to(sinks_N.astype(f32)[None, :, None], (B, N, T))
        top_BNT = jnp.maximum(top_BNT, sink_BNT)
    row_BNT = jnp.any(allowed_BNTS, axis=-1)
    top_BNT = jnp.where(row_BNT, top_BNT, 0.0)
    e_BNTS = jnp.where(allowed_BNTS, jnp.exp(z_BNTS - top_BNT[..., None]), 0.0)
    total_BNT = e_BNTS.sum(-1)
    if sinks_N is not None:
        e_sink_BNT = jnp.exp(sink_BNT - top_BNT)
        total_BNT = total_BNT + e_sink_BNT
    total_BNT = jnp.where(row_BNT, total_BNT, 1.0)
    p_BNTS = e_BNTS / total_BNT[..., None]
    plogp_BNTS = jnp.where(p_BNTS > 0, p_BNTS * jnp.log(jnp.where(p_BNTS > 0, p_BNTS, 1.0)), 0.0)
    entropy_BNT = -plogp_BNTS.sum(-1)
    if sinks_N is not None:
        p_sink_BNT = e_sink_BNT / total_BNT
        entropy_BNT = entropy_BNT - jax.scipy.special.xlogy(p_sink_BNT, p_sink_BNT)
    rows = row_BNT.astype(f32)
    return {
        "max_logit": max_logit,
        "entropy_sum": jnp.sum(entropy_BNT * rows),
        "first_sum": jnp.sum(p_BNTS[..., 0] * rows),
        "rows": jnp.sum(rows),
    }
