"""Boolean attention masks, True = may attend, broadcastable to ``[B, N|1, T, S]``.

Every mask is built from *positions*, so the same functions serve a full forward pass
(queries at 0..T-1 over keys 0..S-1) and a decode step whose queries sit at position ``p``
of a longer cache: pass ``offset=p`` (a scalar, or one offset per batch row, ``[B]``).
Functions that take an offset return ``[1, 1, T, S]`` for a scalar offset and
``[B, 1, T, S]`` for a per-row one. ``combine`` ANDs any number of masks (``None`` = no mask).

A ``MaskSpec`` describes a mask instead of holding it: absolute query and key positions
plus the rules (causal, sliding window, segments, padding, cache lengths, prefix-LM) that
the functions here apply to them. It costs ``O(T + S)`` memory, gives any block of the mask
on demand (``block``), the whole mask (``dense``, equal to what the functions here build),
and a cheap per-block test of which (query block, key block) pairs can hold an allowed
entry at all (``block_any``), so blockwise attention (``implementation="chunked"``) never
builds ``[T, S]`` and skips the blocks the rules rule out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Finite stand-in for -inf in masked logits: softmax and its gradient stay free of NaN on
# rows with every key masked (attention, chunked and ring attention share it).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _query_positions(T, offset):
    """[B|1, T] absolute positions of T queries starting at ``offset`` (a NumPy array when
    the offset is a Python int: known while tracing, so paths can see the positions are the
    indices)."""
    if isinstance(offset, int):
        return offset + np.arange(T, dtype=np.int32)[None, :]
    offset = jnp.asarray(offset, jnp.int32)
    if offset.ndim == 0:
        offset = offset[None]
    return offset[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


def lengths_to_valid(lengths_B, max_len):
    """[B, max_len] validity from per-row lengths (positions < length are valid)."""
    return jnp.arange(max_len)[None, :] < jnp.asarray(lengths_B)[:, None]


def causal(T, S=None, *, offset=0):
    """Query at absolute position ``offset + t`` may attend keys ``s <= offset + t``."""
    S = T if S is None else S
    q_pos_BT = _query_positions(T, offset)
    return (jnp.arange(S)[None, None, :] <= q_pos_BT[:, :, None])[:, None]


def sliding_window(T, S=None, *, window, offset=0):
    """Causal local attention: keys ``q - window < s <= q`` (``window`` keys including self).

    ``window`` may be traced (a per-layer value inside a scan over layers).
    """
    if isinstance(window, int) and window < 1:
        raise ValueError(f"sliding_window: window must be >= 1, got {window}")
    S = T if S is None else S
    q_pos_BT1 = _query_positions(T, offset)[:, :, None]
    k_pos_11S = jnp.arange(S)[None, None, :]
    return ((k_pos_11S <= q_pos_BT1) & (k_pos_11S > q_pos_BT1 - window))[:, None]


def padding(q_valid_BT=None, k_valid_BS=None):
    """Mask from query and/or key validity arrays (bool ``[B, T]`` / ``[B, S]``).

    With both given this is the cross-attention mask (query validity x key validity). Padded
    queries get fully masked rows, which attention turns into zero outputs.
    """
    if q_valid_BT is None and k_valid_BS is None:
        return None
    if k_valid_BS is None:
        return jnp.asarray(q_valid_BT, bool)[:, None, :, None]
    k = jnp.asarray(k_valid_BS, bool)[:, None, None, :]
    if q_valid_BT is None:
        return k
    return jnp.asarray(q_valid_BT, bool)[:, None, :, None] & k


def padding_from_lengths(q_lengths_B=None, k_lengths_B=None, *, T=None, S=None):
    """``padding`` from per-row lengths (positions ``< length`` are valid)."""
    q = None if q_lengths_B is None else lengths_to_valid(q_lengths_B, T)
    k = None if k_lengths_B is None else lengths_to_valid(k_lengths_B, S)
    return padding(q, k)


def cross(q_valid_BT, k_valid_BS):
    """Cross-attention mask: decoder query validity x encoder key validity."""
    return padding(q_valid_BT, k_valid_BS)


def segment(q_segment_ids_BT, k_segment_ids_BS=None):
    """Packed documents: attend only within the same segment id (0 = padding, never attends)."""
    q = jnp.asarray(q_segment_ids_BT)
    k = q if k_segment_ids_BS is None else jnp.asarray(k_segment_ids_BS)
    same_BTS = q[:, :, None] == k[:, None, :]
    return (same_BTS & (q[:, :, None] > 0) & (k[:, None, :] > 0))[:, None]


def prefix_lm(prefix_lengths_B, T, S=None, *, offset=0):
    """Prefix-LM: bidirectional over the first ``prefix_length`` keys, causal after."""
    S = T if S is None else S
    prefix_B = jnp.asarray(prefix_lengths_B)
    in_prefix_B1S = jnp.arange(S)[None, None, :] < prefix_B[:, None, None]
    return causal(T, S, offset=offset) | in_prefix_B1S[:, None]


def combine(*masks):
    """Logical AND of masks, skipping ``None``; ``None`` when all are ``None``."""
    out = None
    for m in masks:
        if m is None:
            continue
        m = jnp.asarray(m, bool)
        out = m if out is None else out & m
    return out


def _static(default=None):
    return dataclasses.field(default=default, metadata=dict(static=True))


def _and(a, b):
    return b if a is None else a & b


def _pad_last(x, size, *, value=None):
    """``x`` padded on its last axis to ``size``: with ``value``, else repeating the edge."""
    if x is None or x.shape[-1] == size:
        return x
    widths = [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])]
    if value is None:
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _pad_TS(allowed, T, S):
    """``allowed`` ``[B|1, N|1, T0, S0]`` padded with False to ``[.., T, S]``."""
    allowed = jnp.asarray(allowed, bool)
    t, s = allowed.shape[-2:]
    return jnp.pad(allowed, [(0, 0), (0, 0), (0, T - t), (0, S - s)])


def _blocks(allowed, T, S, block_q, block_k):
    """``[B * N, nq, block_q, nk, block_k]``: ``allowed`` over ``[T, S]`` cut into blocks, its
    head axis folded into the rows (the block tables hold one entry for every row)."""
    allowed = jnp.broadcast_to(jnp.asarray(allowed, bool), (*jnp.shape(allowed)[:2], T, S))
    B, N = allowed.shape[:2]
    return allowed.reshape(B * N, T // block_q, block_q, S // block_k, block_k)


def _block_range(x_BT, block):
    """Per-block (min, max) of ``x`` over its last axis: two ``[B, n]`` arrays."""
    x = x_BT.reshape(x_BT.shape[0], -1, block)
    return x.min(-1), x.max(-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """A mask as positions and rules; entry ``(b, t, s)`` may attend when every rule given
    allows it (``p = q_pos[b, t]``, ``k = k_pos[b, s]``):

    * ``causal``: ``k <= p``, or with ``prefix_length`` also ``k < prefix_length[b]``
      (prefix-LM: bidirectional over the prefix, causal after, as ``prefix_lm``);
    * ``window`` (an int or a traced int32 scalar, one layer's window inside a scan over
      layers): ``p - window < k <= p``, as ``sliding_window``;
    * ``q_segment``/``k_segment``: equal non-zero segment ids (0 = padding), as ``segment``;
    * ``k_length``: key index ``s < k_length[b]`` (padding, or the written part of a cache);
    * ``k_valid``/``q_valid``: ``k_valid[b, s]`` and ``q_valid[b, t]``, as ``padding``;
    * ``allowed``: ``allowed[b, n, t, s]`` (``[B|1, N|1, T, S]`` bool), a choice of keys per
      query that no rule describes (a sparse mixer's selection), kept beside the positions
      so a score function still sees them (``ops.dot_product_attention`` gives the paths
      ``dense()`` of such a spec).

    Positions are ``[B|1, T]`` / ``[B|1, S]`` int32; per-row fields are ``[B, ...]``. The
    class is a pytree (``causal`` is static), so it passes through ``jit`` and ``scan``.
    Build one with ``for_sequence`` or ``for_cache``; ``replace`` changes fields.
    """

    q_pos: Any  # [B|1, T] int32
    k_pos: Any  # [B|1, S] int32
    causal: bool = _static(False)
    window: Any = None  # None, int or int32 scalar
    q_segment: Any = None  # [B, T] int32
    k_segment: Any = None  # [B, S] int32
    k_length: Any = None  # [B] int32
    k_valid: Any = None  # [B, S] bool
    q_valid: Any = None  # [B, T] bool
    prefix_length: Any = None  # [B] int32
    allowed: Any = None  # [B|1, N|1, T, S] bool
    # Queries and keys both at 0..T-1 in order (``for_sequence`` with offset 0): with
    # ``causal`` and no other rule the mask is the plain causal triangle, which fused
    # kernels take as a flag (``is_causal``) instead of a [T, S] array.
    aligned: bool = _static(False)

    @classmethod
    def for_sequence(
        cls,
        T,
        S=None,
        *,
        causal=False,
        window=None,
        segment_ids=None,
        k_segment_ids=None,
        k_valid=None,
        q_valid=None,
        k_length=None,
        prefix_length=None,
        offset=0,
    ):
        """Queries at ``offset + 0..T-1`` over keys at ``0..S-1`` (``S`` defaults to ``T``).

        ``segment_ids`` are the queries' (and, without ``k_segment_ids``, the keys')
        segments; ``k_valid`` / ``q_valid`` mark real keys / queries.
        """
        S = T if S is None else S
        if isinstance(window, int) and window < 1:
            raise ValueError(f"MaskSpec: window must be >= 1, got {window}")
        if prefix_length is not None and not causal:
            raise ValueError("MaskSpec: prefix_length relaxes the causal rule; pass causal=True")
        if segment_ids is not None and k_segment_ids is None:
            if T != S:
                raise ValueError(f"MaskSpec: T={T} != S={S}: pass k_segment_ids for the keys")
            k_segment_ids = segment_ids
        arr = lambda x, dt: None if x is None else jnp.asarray(x, dt)
        aligned = T == S and isinstance(offset, int) and offset == 0
        return cls(
            q_pos=_query_positions(T, offset),
            k_pos=np.arange(S, dtype=np.int32)[None, :],  # NumPy: known while tracing
            causal=causal,
            # A Python int stays one (static: a library kernel with a static mask, splash,
            # takes it inside jit); a traced window (one layer's, in a scan) stays traced.
            window=window if isinstance(window, int) else arr(window, jnp.int32),
            q_segment=arr(segment_ids, jnp.int32),
            k_segment=arr(k_segment_ids, jnp.int32),
            k_length=arr(k_length, jnp.int32),
            k_valid=arr(k_valid, bool),
            q_valid=arr(q_valid, bool),
            prefix_length=arr(prefix_length, jnp.int32),
            aligned=aligned,
        )

    @classmethod
    def for_cache(cls, T, S, start_B, *, causal=True, window=None):
        """``T`` new queries of row ``b`` at ``start_B[b] + t`` over ``S`` cache slots, of
        which the first ``start_B[b] + T`` are written (the new keys included)."""
        start_B = jnp.asarray(start_B, jnp.int32)
        return cls.for_sequence(
            T, S, causal=causal, window=window, k_length=start_B + T, offset=start_B
        )

    @property
    def shape(self):
        """``(T, S)``."""
        return self.q_pos.shape[-1], self.k_pos.shape[-1]

    def replace(self, **changes):
        """A copy with ``changes`` to the fields (new positions are no longer ``aligned``
        unless the changes say so)."""
        if ("q_pos" in changes or "k_pos" in changes) and "aligned" not in changes:
            changes["aligned"] = False
        return dataclasses.replace(self, **changes)

    @property
    def causal_only(self) -> bool:
        """Whether the mask is exactly the causal triangle over aligned positions (no window,
        segments, lengths, validity or prefix): what ``is_causal=True`` computes."""
        others = (self.window, self.q_segment, self.k_segment, self.k_length, self.k_valid,
                  self.q_valid, self.prefix_length, self.allowed)  # fmt: skip
        return self.causal and self.aligned and all(x is None for x in others)

    def _position_rule(self, q_last, k_first, q_first, k_last):
        """The causal, prefix and window rules (None without them) for queries and keys at
        the given positions: single positions (each pair of arguments the same), or the ends
        of blocks of them (``_block_rule``)."""
        out = None
        if self.causal:
            out = k_first <= q_last
            if self.prefix_length is not None:
                out = out | (k_first < jnp.asarray(self.prefix_length)[:, None, None])
        if self.window is not None:
            window = jnp.asarray(self.window, jnp.int32)
            out = _and(out, (k_first <= q_last) & (k_last > q_first - window))
        return out

    def _allowed(self, q_pos, k_pos, k_index_S, q_seg, k_seg, q_valid, k_valid):
        """[B|1, 1, t, s] mask of the given slices of the position-indexed fields."""
        p, k = q_pos[:, :, None], k_pos[:, None, :]
        out = self._position_rule(p, k, p, k)
        if (q_seg is None) != (k_seg is None):
            raise ValueError("MaskSpec: give both q_segment and k_segment, or neither")
        if q_seg is not None:
            q, kk = q_seg[:, :, None], k_seg[:, None, :]
            out = _and(out, (q == kk) & (q > 0) & (kk > 0))
        if self.k_length is not None:
            length = jnp.asarray(self.k_length)[:, None, None]
            out = _and(out, k_index_S[None, None, :] < length)
        if k_valid is not None:
            out = _and(out, k_valid[:, None, :])
        if q_valid is not None:
            out = _and(out, q_valid[:, :, None])
        t, s = q_pos.shape[-1], k_pos.shape[-1]
        if out is None:
            out = jnp.ones((1, t, s), bool)
        return jnp.broadcast_to(out, (out.shape[0], t, s))[:, None]

    def dense(self):
        """The whole ``[B|1, 1, T, S]`` mask (``[B|1, N|1, T, S]`` with ``allowed``)."""
        T, S = self.shape
        out = self._allowed(
            self.q_pos,
            self.k_pos,
            jnp.arange(S, dtype=jnp.int32),
            self.q_segment,
            self.k_segment,
            self.q_valid,
            self.k_valid,
        )
        return out if self.allowed is None else out & jnp.asarray(self.allowed, bool)

    def block(self, q_start, size_q, k_start, size_k):
        """The ``[B|1, 1, size_q, size_k]`` block of queries ``q_start + 0..size_q-1`` and
        keys ``k_start + 0..size_k-1`` (starts may be traced; blocks must lie inside)."""
        q = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, q_start, size_q, 1)
        k = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, k_start, size_k, 1)
        k_index_S = k_start + jnp.arange(size_k, dtype=jnp.int32)
        out = self._allowed(
            q(self.q_pos),
            k(self.k_pos),
            k_index_S,
            q(self.q_segment),
            k(self.k_segment),
            q(self.q_valid),
            k(self.k_valid),
        )
        if self.allowed is None:
            return out
        block = jax.lax.dynamic_slice_in_dim(jnp.asarray(self.allowed, bool), q_start, size_q, 2)
        return out & jax.lax.dynamic_slice_in_dim(block, k_start, size_k, 3)

    def padded(self, T, S):
        """The spec over ``T >= T0`` queries and ``S >= S0`` keys: positions and segments
        repeat the last one, validity is False. The added keys are *not* masked by every
        spec (only with ``k_valid`` or ``k_length``): a caller that pads masks them itself."""
        return self.replace(
            q_pos=_pad_last(self.q_pos, T),
            k_pos=_pad_last(self.k_pos, S),
            q_segment=_pad_last(self.q_segment, T),
            k_segment=_pad_last(self.k_segment, S),
            q_valid=_pad_last(self.q_valid, T, value=False),
            k_valid=_pad_last(self.k_valid, S, value=False),
            allowed=None if self.allowed is None else _pad_TS(self.allowed, T, S),
        )

    def _block_rule(self, block_q, block_k, *, every: bool):
        """``block_any`` (``every=False``: some entry of the block may attend) or ``block_all``
        (``every=True``: each entry may, in every batch row), from per-block position,
        segment and validity ranges; T and S must be multiples of the blocks.

        One rule serves both: a query block's (min, max) and a key block's are read as the
        (least, most) favourable ends for "some", swapped for "every"."""
        caller = "block_all" if every else "block_any"
        reduce = jnp.all if every else jnp.any
        T, S = self.shape
        if T % block_q or S % block_k:
            raise ValueError(f"{caller}: T={T}, S={S} must be multiples of {block_q}, {block_k}")
        nq, nk = T // block_q, S // block_k
        q_min, q_max = (x[:, :, None] for x in _block_range(self.q_pos, block_q))
        k_min, k_max = (x[:, None, :] for x in _block_range(self.k_pos, block_k))
        if every:  # the nearest query against the farthest key
            (q_min, q_max), (k_min, k_max) = (q_max, q_min), (k_max, k_min)
        out = self._position_rule(q_max, k_min, q_min, k_max)  # [B|1, nq, nk]
        if self.q_segment is not None:
            qs_min, qs_max = (x[:, :, None] for x in _block_range(self.q_segment, block_q))
            ks_min, ks_max = (x[:, None, :] for x in _block_range(self.k_segment, block_k))
            if every:  # one segment on both sides
                same = (qs_min == qs_max) & (ks_min == ks_max) & (qs_min == ks_min)
                out = _and(out, same & (qs_min > 0))
            else:  # the segment ranges overlap
                overlap = (qs_min <= ks_max) & (ks_min <= qs_max)
                out = _and(out, overlap & (qs_max > 0) & (ks_max > 0))
        if self.k_length is not None:  # the block's first key (some) or last key (every)
            first = jnp.arange(nk, dtype=jnp.int32) * block_k + (block_k - 1 if every else 0)
            out = _and(out, first[None, None, :] < jnp.asarray(self.k_length)[:, None, None])
        if self.k_valid is not None:
            k_valid = self.k_valid.reshape(self.k_valid.shape[0], 1, nk, block_k)
            out = _and(out, reduce(k_valid, axis=-1))
        if self.q_valid is not None:
            q_valid = self.q_valid.reshape(self.q_valid.shape[0], -1, block_q)
            out = _and(out, reduce(q_valid, axis=-1)[:, :, None])
        if self.allowed is not None:
            blocks = _blocks(self.allowed, T, S, block_q, block_k)
            out = _and(out, reduce(blocks, axis=(0, 2, 4))[None])
        if out is None:
            return jnp.ones((nq, nk), bool)
        return reduce(jnp.broadcast_to(out, (out.shape[0], nq, nk)), axis=0)

    def block_any(self, block_q, block_k):
        """``[T / block_q, S / block_k]`` bool: False where no entry of the (query block,
        key block) pair may attend, from per-block position, segment and validity ranges.

        True is conservative (a block may still be fully masked); False is exact, so a
        blockwise kernel may skip those blocks. T and S must be multiples of the blocks.
        """
        return self._block_rule(block_q, block_k, every=False)

    def block_all(self, block_q, block_k):
        """``[T / block_q, S / block_k]`` bool: True where every entry of the (query block,
        key block) pair may attend, in every batch row, so a kernel may skip evaluating the
        mask there. False is conservative (the block may still be full); True is exact.
        T and S must be multiples of the blocks."""
        return self._block_rule(block_q, block_k, every=True)
