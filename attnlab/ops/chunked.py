"""Memory-efficient attention: blockwise over queries and keys, in pure JAX.

``chunked_attention`` computes the same function as ``reference_attention`` (see
``attnlab.ops.attention`` for the conventions) without building the ``[B, N, T, S]``
logits: queries are cut into blocks of ``block_q`` and keys into blocks of ``block_k``,
and each query block runs the online softmax over its key blocks (the FlashAttention
recurrence, in at least float32): a running row maximum ``m``, normaliser ``denom`` and output
accumulator, rescaled by ``exp(m_old - m_new)`` when the maximum grows.

Memory is linear in T and S. The backward pass is a ``jax.custom_vjp`` whose residuals are
the inputs, the output and the per-row log-sum-exp; it recomputes each block's weights
``p = exp(s - lse)`` and, looping over key blocks (and, inside, their query blocks), builds
``dV += p^T dO``, ``dS = p * (dO V^T - D)`` with ``D = rowsum(dO * O)``, ``dK += dS^T Q``
and ``dQ += dS K``. Without it, JAX would save every block's weights for the backward pass,
which is the ``[T, S]`` memory this function exists to avoid. The backward pass is
``attnlab.ops.chunked_backward``; the block pieces both passes use (logits, score function,
mask and bias slices, the loops) are ``attnlab.ops.chunked_blocks``.

Soft-capping (``softcap``, static) replaces each block's logits by ``c * tanh(s / c)``
before masking, and the backward pass multiplies ``dS`` by ``1 - tanh^2(s / c)``. Sinks
(per-head logits that join the denominator without a value) are applied to the result:
with ``lse`` the log-sum-exp of the real logits, ``out = out_plain * sigmoid(lse - sink)``,
since ``exp(lse) / (exp(lse) + exp(sink))`` is the share the real keys keep. The custom VJP
returns ``lse`` beside the output for this, and takes its cotangent: ``d lse / d s = p``,
so ``dS = p * (dO V^T - D + d lse)``.

A score function (``score_mod(score, b, h, q_idx, kv_idx)``, ``attnlab.ops.score_mods``)
is applied to each block's capped logits before the mask. Every array it closes over, of
any dtype, is hoisted out (``score_mods.convert``) and becomes an explicit input of the
custom VJP; the backward pass pulls ``dS`` back through it per block (``jax.vjp``), adding
the gradients of the float arrays as it goes (integer and boolean ones get ``float0``).

Masks and biases may be dense (sliced per block) or descriptions: a ``masks.MaskSpec``
(positions and rules, evaluated per block) and a ``positions.PositionBias`` (ALiBi or T5
buckets evaluated per block, gradients to its parameters included). A ``BlockMask``
(``attnlab.ops.block_mask``, built once per call and shared by both passes) says which
(query block, key block) pairs to visit: each query block loops only over its non-empty key
blocks (``kind_QK``), the backward pass's key blocks over their non-empty query blocks, so
causal attention does about half the work, and in two loops: first the ``FULL`` pairs,
without evaluating the mask, then the ``PARTIAL`` ones, with it (no branch per block). Lengths
need not divide the blocks: inputs are padded and the padded keys masked.
GQA/MQA: queries are grouped ``[B, K, G, T, H]``, keys and values are never repeated.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.ops import score_mods
from attnlab.ops.block_mask import BlockMask
from attnlab.ops.chunked_backward import backward
from attnlab.ops.chunked_blocks import (
    Static,
    loops,
    mask_block,
    mod_fn,
    pad_axis,
    scores,
    to_BKG,
    visit_order,
)
from attnlab.ops.masks import MASK_VALUE, MaskSpec
from attnlab.ops.positions import PositionBias
from attnlab.ops.precision import upcast, wide

# Measured on a 2-core CPU (benchmarks/attention.py, H=64): 128-256 blocks run the block
# dots at about the speed of one dense [T, S] dot; 512 was 1.5x and 1024 3x slower (their
# [tq, tk] float32 logits fall out of cache), and smaller blocks skip causal work more finely.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256


def _forward(st: Static, q, k, v, mask, bias, bm: BlockMask, q_off, consts):
    """(out [B, K, G, T, H], lse [B, K, G, T]) of padded, head-major inputs."""
    B, K, G, T_pad, H = q.shape
    cdt = wide(q, k)  # float32, or float64 for a float64 model
    S_pad = k.shape[2]
    tq, tk = st.block_q, st.block_k
    nq = T_pad // tq
    order, n_full, n_any = visit_order(bm.kind_QK)

    def query_block(_, i):
        q_blk = jax.lax.dynamic_slice_in_dim(q, i * tq, tq, 3)

        def key_block(c, carry, masked):
            j = order[i, c]
            k_blk = jax.lax.dynamic_slice_in_dim(k, j * tk, tk, 2)
            v_blk = jax.lax.dynamic_slice_in_dim(v, j * tk, tk, 2)
            m, denom, acc = carry
            s, _ = scores(st, q_blk, k_blk, bias, i, j)
            if st.score_mod is not None:
                s = mod_fn(st, s.shape, q_off, i, j)(s, consts)
            allowed = mask_block(mask, i, j, st, S_pad) if masked else None
            if allowed is not None:
                s = jnp.where(allowed, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            if allowed is not None:  # a row masked so far has m_new == MASK_VALUE: p = 1
                p = jnp.where(allowed, p, 0.0)
            correction = jnp.exp(m - m_new)
            denom = denom * correction + p.sum(-1)
            pv = jnp.einsum(
                "BKGts,BKsH->BKGtH",
                p.astype(v.dtype),
                v_blk,
                preferred_element_type=cdt,
            )
            return m_new, denom, acc * correction[..., None] + pv

        init = (
            jnp.full((B, K, G, tq), MASK_VALUE, cdt),
            jnp.zeros((B, K, G, tq), cdt),
            jnp.zeros((B, K, G, tq, H), cdt),
        )
        m, denom, acc = loops(st, key_block, n_full[i], n_any[i], init)
        seen = denom > 0.0  # False: a fully masked row, whose output is zero
        out = jnp.where(seen[..., None], acc / jnp.where(seen, denom, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), jnp.inf)
        return None, (out.astype(q.dtype), lse)

    _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(nq, dtype=jnp.int32))
    out = jnp.moveaxis(out, 0, 3).reshape(B, K, G, T_pad, H)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, G, T_pad)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st, q, k, v, mask, bias, bm, q_off, consts):
    return _forward(st, q, k, v, mask, bias, bm, q_off, consts)


def _attention_fwd(st, q, k, v, mask, bias, bm, q_off, consts):
    out, lse = _forward(st, q, k, v, mask, bias, bm, q_off, consts)
    return (out, lse), (q, k, v, mask, bias, bm, q_off, consts, out, lse)


_attention.defvjp(_attention_fwd, backward)


def _static(name, value):
    try:
        return float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ValueError(
            f"implementation='chunked' needs a Python number for {name} (it is static in the "
            "custom backward pass); pass a float, or use implementation='reference'"
        ) from None


def chunked_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    mask=None,
    bias=None,
    scale=None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    sinks=None,
    softcap: float | None = None,
    score_mod=None,
    block_mask: BlockMask | None = None,
    q_offset=None,
):
    """Blockwise attention; returns ``out_BTNH`` (dtype of ``q``), as ``reference_attention``.

    Args:
      q_BTNH, k_BSKH, v_BSKH: queries, keys, values (bf16 or f32); K must divide N.
      mask: None, a ``MaskSpec``, or a boolean array broadcastable to [B, N|1, T, S].
      bias: None, a ``PositionBias``, or an array broadcastable to [B, N|1, T, S].
      scale: logit scale (a Python number); defaults to 1/sqrt(H).
      block_q, block_k: block sizes (capped at T and S); need not divide T or S.
      sinks: per-head sink logits [N], or None.
      softcap: ``c`` of the logit cap ``c * tanh(s / c)`` (a positive Python number), or None.
      score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` (``attnlab.ops.score_mods``),
        applied after the cap and before the mask; gradients reach the arrays it closes over.
      block_mask: the ``BlockMask`` of ``mask`` for these blocks (None: built here).
      q_offset: added to the query indices ``score_mod`` sees (an int or [B] int32).
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise ValueError(f"chunked attention: {name}={value!r} must be a positive integer")
    tq, tk = min(int(block_q), T), min(int(block_k), S)
    T_pad, S_pad = tq * math.ceil(T / tq), tk * math.ceil(S / tk)
    scale = H**-0.5 if scale is None else _static("scale", scale)
    if softcap is not None:
        softcap = _static("softcap", softcap)
        if not softcap > 0:
            raise ValueError(f"softcap={softcap} must be positive (the cap's c in c*tanh(s/c))")
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.shape != (N,):
            raise ValueError(f"sinks must hold one logit per query head, [{N}]; got {sinks.shape}")
    q_off = jnp.zeros((1,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32)
    q_off = q_off.reshape(-1)  # [1|B]
    consts, fn = (), None
    if score_mod is not None:  # converted for the index shapes every block passes
        shape = (B, K, G, tq, tk)
        score_mods.check_result(score_mod, shape, q_off.shape[0])
        fn, consts = score_mods.convert(score_mod, shape, q_off.shape[0])

    if isinstance(mask, MaskSpec) and mask.shape != (T, S):
        raise ValueError(f"MaskSpec covers (T, S)={mask.shape}, the inputs ({T}, {S})")
    if block_mask is None:
        block_mask = _block_mask(mask, T, S, tq, tk)
    elif (block_mask.block_q, block_mask.block_k, block_mask.T, block_mask.S) != (tq, tk, T, S):
        raise ValueError(
            f"block_mask: built for blocks ({block_mask.block_q}, {block_mask.block_k}) over "
            f"(T, S)=({block_mask.T}, {block_mask.S}); this call has blocks ({tq}, {tk}) over "
            f"({T}, {S}): build it with BlockMask.from_spec(mask, {T}, {S}, block_q={tq}, "
            f"block_k={tk}), or pass None"
        )
    all_full = mask is None and S_pad == S
    st = Static(scale, softcap, tq, tk, S, T=T, score_mod=fn, all_full=all_full)

    q = jnp.transpose(q_BTNH.reshape(B, T, K, G, H), (0, 2, 3, 1, 4))  # [B, K, G, T, H]
    q = pad_axis(q, 3, T_pad)
    k, v = (pad_axis(jnp.swapaxes(x, 1, 2), 2, S_pad) for x in (k_BSKH, v_BSKH))

    if isinstance(mask, MaskSpec):
        mask = mask.padded(T_pad, S_pad)
    elif mask is not None:
        mask = pad_axis(pad_axis(to_BKG(_dense_mask(mask), K, G), 3, T_pad, False), 4, S_pad, False)
    if isinstance(bias, PositionBias):
        bias = bias.replace(
            q_pos=_pad_edge(jnp.asarray(bias.q_pos), T_pad),
            k_pos=_pad_edge(jnp.asarray(bias.k_pos), S_pad),
        )
    elif bias is not None:
        bias = jnp.asarray(bias)
        if bias.ndim != 4:
            raise ValueError(f"masks and biases must be 4-D [B, N|1, T, S], got {bias.shape}")
        bias = pad_axis(pad_axis(to_BKG(bias, K, G), 3, T_pad), 4, S_pad)

    out, lse = _attention(st, q, k, v, mask, bias, block_mask, q_off, consts)
    out, lse = out[:, :, :, :T], lse[:, :, :, :T]  # [B, K, G, T, H], [B, K, G, T]
    if sinks is not None:  # the real keys' share (a fully masked row: lse = inf, out stays 0)
        sink_1KG1 = upcast(sinks).reshape(1, K, G, 1)
        kept = jax.nn.sigmoid(lse - sink_1KG1)[..., None]
        out = (upcast(out) * kept).astype(q.dtype)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H)


def _dense_mask(mask):
    mask = jnp.asarray(mask, bool)
    if mask.ndim != 4:
        raise ValueError(f"masks and biases must be 4-D [B, N|1, T, S], got {mask.shape}")
    return mask


def _block_mask(mask, T, S, tq, tk) -> BlockMask:
    """The ``BlockMask`` of a ``MaskSpec``, a dense mask or None, over blocks (tq, tk)."""
    if mask is None or isinstance(mask, MaskSpec):
        return BlockMask.from_spec(mask, T, S, block_q=tq, block_k=tk)
    mask = _dense_mask(mask)
    mask = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], T, S))
    return BlockMask.from_dense(mask, block_q=tq, block_k=tk)


def _pad_edge(x_BT, size):
    if x_BT.shape[-1] == size:
        return x_BT
    return jnp.pad(x_BT, [(0, 0), (0, size - x_BT.shape[-1])], mode="edge")
