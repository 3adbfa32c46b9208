"""Block selection for sparse attention: which key blocks each query attends, as masks.

Two mixers choose, per query, a few blocks of keys and attend only those: Mixture of Block
Attention (``mixer="moba"``) and Native Sparse Attention's selected branch (``mixer="nsa"``).
The functions here turn that choice into the boolean masks ``flex_attention`` takes (True =
may attend), so its blockwise paths skip the key blocks that no query of a block chose.

Coordinates are key indices (cache slots when decoding; in a forward pass the same as
positions): key ``s`` lies in block ``s // block``, a query at ``q_pos`` in block
``q_pos // block``. Besides the dimension key (``attnlab.dims``), ``J`` counts key blocks
and ``C`` compressed blocks (NSA's blocks of ``length`` keys every ``stride``) here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.ops.masks import MASK_VALUE
from attnlab.ops.precision import upcast
from attnlab.ops.sparse_index import top_k_mask


def n_blocks(S: int, block: int) -> int:
    """How many blocks of ``block`` keys cover ``S`` keys (the last may be partial)."""
    return max(1, math.ceil(S / block))


def top_blocks(score_BNTJ, allowed_BNTJ, forced_BNTJ, topk: int):
    """``[B, N, T, J]`` bool: per query, the ``forced`` blocks and the highest-scoring
    ``allowed`` ones, ``topk`` in all (the forced ones count; fewer when fewer are allowed).
    Forced blocks must be allowed."""
    score = jnp.where(forced_BNTJ, jnp.inf, upcast(score_BNTJ))
    return top_k_mask(jax.lax.stop_gradient(score), allowed_BNTJ, topk)


def blocks_to_keys(chosen_BNTJ, block: int, S: int):
    """``[B, N, T, S]`` bool: key ``s`` is chosen when its block ``s // block`` is."""
    owner_S = jnp.arange(S, dtype=jnp.int32) // block
    return jnp.take(chosen_BNTJ, owner_S, axis=-1)


def block_means(k_BSKH, block: int):
    """``[B, J, K, H]``: the mean of each block's keys (a partial last block: its own)."""
    B, S, K, H = k_BSKH.shape
    J = n_blocks(S, block)
    pad = J * block - S
    k = jnp.pad(upcast(k_BSKH), [(0, 0), (0, pad), (0, 0), (0, 0)])
    sizes_J = upcast(jnp.minimum(block, S - jnp.arange(J) * block))
    return k.reshape(B, J, block, K, H).sum(2) / sizes_J[None, :, None, None]


def moba_selection(q_BTNH, k_BSKH, q_pos_BT, *, block: int, topk: int):
    """MoBA's gate (Lu et al. 2025, eqs. 5-6): query ``t`` of head ``n`` scores each past
    block ``j`` by ``q . mean(K_j)`` (its kv-head's keys), keeps the ``topk`` best past
    blocks and always its own block; ``[B, N, T, J]`` bool."""
    B, T, N, _ = q_BTNH.shape
    K = k_BSKH.shape[2]
    mean_BJKH = block_means(k_BSKH, block)
    J = mean_BJKH.shape[1]
    q_BTKGH = upcast(q_BTNH).reshape(B, T, K, N // K, -1)
    score_BKGTJ = jnp.einsum("BTKGH,BJKH->BKGTJ", q_BTKGH, mean_BJKH)
    score_BNTJ = score_BKGTJ.reshape(B, N, T, J)
    own_BT1 = (jnp.asarray(q_pos_BT, jnp.int32) // block)[:, :, None]
    j_J = jnp.arange(J, dtype=jnp.int32)[None, None, :]
    past_BNTJ = jnp.broadcast_to((j_J < own_BT1)[:, None], score_BNTJ.shape)
    own_B1TJ = (j_J == own_BT1)[:, None]
    chosen = top_blocks(score_BNTJ, past_BNTJ, jnp.zeros_like(past_BNTJ), topk)
    return chosen | own_B1TJ


def compression_starts(S: int, length: int, stride: int) -> np.ndarray:
    """The first key of each compression block, ``[C]``: blocks ``[i stride, i stride +
    length)`` while they fit in ``S`` keys (at least one, which may reach past ``S``)."""
    C = max(0, (S - length) // stride) + 1
    return np.arange(C) * stride


def compression_blocks(x_BSKH, *, length: int, stride: int):
    """``[B, C, P, K, H]``: NSA's blocks of ``P = length`` consecutive keys (or values)
    every ``stride`` (eq. 7), zero past the last key."""
    S = x_BSKH.shape[1]
    starts_C = compression_starts(S, length, stride)
    need = int(starts_C[-1]) + length
    x = jnp.pad(x_BSKH, [(0, 0), (0, max(0, need - S)), (0, 0), (0, 0)])
    index_CP = starts_C[:, None] + np.arange(length)[None, :]
    return x[:, index_CP]


def compression_allowed(mask_B1TS, *, length: int, stride: int):
    """``[B|1, 1, T, C]``: a query may attend compression block ``i`` when it may attend
    every key of the block (causal: the block is complete; keys past ``S`` never)."""
    S = mask_B1TS.shape[-1]
    starts_C = compression_starts(S, length, stride)
    need = int(starts_C[-1]) + length
    m = jnp.pad(mask_B1TS, [(0, 0), (0, 0), (0, 0), (0, max(0, need - S))])
    index_CP = starts_C[:, None] + np.arange(length)[None, :]
    return m[..., index_CP].all(-1)


def compressed_attention(q_BTNH, k_BCKH, v_BCKH, allowed_B1TC, *, scale: float):
    """``(out_BTNH, probs_BNTC)``: softmax attention over the compressed keys (eq. 5 with
    eq. 7's keys); a query with no allowed block gets zeros (output and probabilities)."""
    B, T, N, H = q_BTNH.shape
    K = k_BCKH.shape[2]
    q_BTKGH = upcast(q_BTNH.reshape(B, T, K, N // K, H))
    s_BKGTC = jnp.einsum("BTKGH,BCKH->BKGTC", q_BTKGH, upcast(k_BCKH)) * scale
    s_BNTC = s_BKGTC.reshape(B, N, T, -1)
    s_BNTC = jnp.where(allowed_B1TC, s_BNTC, MASK_VALUE)
    p_BNTC = jax.nn.softmax(s_BNTC, axis=-1)
    p_BNTC = jnp.where(allowed_B1TC.any(-1, keepdims=True), p_BNTC, 0.0)
    p_BKGTC = p_BNTC.reshape(B, K, N // K, T, -1)
    out_BTKGH = jnp.einsum("BKGTC,BCKH->BTKGH", p_BKGTC, upcast(v_BCKH))
    return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype), p_BNTC


def overlaps(S: int, length: int, stride: int, block: int) -> np.ndarray:
    """``[C, J]`` float: 1 where compression block ``i`` (keys ``[i stride, i stride +
    length)``) shares a key with selection block ``j`` (keys ``[j block, (j+1) block)``)."""
    starts_C = compression_starts(S, length, stride)[:, None]
    j_J = np.arange(n_blocks(S, block))[None, :]
    return ((starts_C < (j_J + 1) * block) & (starts_C + length > j_J * block)).astype(np.float32)


def nsa_selection(
    probs_BNTC, q_pos_BT, *, S: int, n_kv_heads: int, length: int, stride: int, block: int,
    top_n: int, local_blocks: int,
):  # fmt: skip
    """NSA's selection (Yuan et al. 2025, eqs. 8-11), ``[B, N, T, J]`` bool: a selection
    block's importance is the compressed attention probability of the compression blocks
    that overlap it (eq. 9), summed over the query heads of a kv-head group so the group
    shares its blocks (eq. 10); each query keeps its ``top_n`` most important blocks (eq.
    11) among those that start at or before it, the first block and its ``local_blocks``
    latest (its own included) always among them."""
    B, N, T, _ = probs_BNTC.shape
    K = n_kv_heads
    p_BNTJ = jnp.einsum("BNTC,CJ->BNTJ", probs_BNTC, overlaps(S, length, stride, block))
    p_BKTJ = p_BNTJ.reshape(B, K, N // K, T, -1).sum(2)
    J = p_BKTJ.shape[-1]
    own_BT1 = (jnp.asarray(q_pos_BT, jnp.int32) // block)[:, :, None]
    j_J = jnp.arange(J, dtype=jnp.int32)[None, None, :]
    allowed_B1TJ = (j_J <= own_BT1)[:, None]
    forced_B1TJ = ((j_J == 0) | (j_J > own_BT1 - local_blocks))[:, None] & allowed_B1TJ
    shape = (B, K, T, J)
    chosen_BKTJ = top_blocks(
        p_BKTJ, jnp.broadcast_to(allowed_B1TJ, shape), jnp.broadcast_to(forced_B1TJ, shape), top_n
    )
    return jnp.repeat(chosen_BKTJ, N // K, axis=1)


def compress(blocks_BCPKH, pos_PH, w_in_PHZ, b_in_Z, w_out_ZH):
    """NSA's learned compression ``phi`` (eq. 7): each block of ``P`` keys (or values) plus
    an intra-block position embedding, flattened, through a one-hidden-layer MLP (SiLU) to
    one vector per kv-head; ``[B, C, K, H]``."""
    x_BCPKH = blocks_BCPKH + pos_PH[None, None, :, None, :].astype(blocks_BCPKH.dtype)
    h_BCKZ = jnp.einsum("BCPKH,PHZ->BCKZ", x_BCPKH, w_in_PHZ.astype(x_BCPKH.dtype))
    h_BCKZ = jax.nn.silu(h_BCKZ + b_in_Z.astype(h_BCKZ.dtype)[None, None, None, :])
    return jnp.einsum("BCKZ,ZH->BCKH", h_BCKZ, w_out_ZH.astype(h_BCKZ.dtype))
