"""Block masks: which (query block, key block) pairs of a mask are empty, partial or full.

A blockwise attention kernel cuts queries into blocks of ``block_q`` and keys into blocks of
``block_k``. For each pair, ``BlockMask.kind_QK`` says

* ``EMPTY``: no entry may attend (in any batch row or head): the kernel skips the pair;
* ``PARTIAL``: some entries may: the kernel computes it and evaluates the mask;
* ``FULL``: every entry may attend (in every row and head): the kernel computes it without
  evaluating the mask.

``EMPTY`` and ``FULL`` are exact, ``PARTIAL`` conservative (it may still be empty or full).
The mask is collapsed over batch rows and heads, so one table serves every program of a
kernel's grid. ``order_QK[i, :count_Q[i]]`` lists query block ``i``'s non-empty key blocks in
ascending order (the forward pass's loop), ``order_KQ[j, :count_K[j]]`` key block ``j``'s
non-empty query blocks (the backward pass's loop for ``dK`` and ``dV``).

A block mask is built once per shape from a ``MaskSpec`` (``from_spec``, from per-block
position ranges: ``O(T + S)`` work, no ``[T, S]`` array), from a dense boolean mask
(``from_dense``), or for no mask at all (``from_spec(None, ...)``), and shared by the
forward and backward passes. Lengths need not divide the blocks: the padded sizes are
``T_pad``/``S_pad``, and a key block holding padded keys is never ``FULL``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from attnlab.ops.masks import MaskSpec

EMPTY, PARTIAL, FULL = 0, 1, 2


def _static(default=None):
    return dataclasses.field(default=default, metadata=dict(static=True))


def _orders(kind_QK):
    """Row-wise: indices of the non-empty entries first (ascending), and their count."""
    nonempty = kind_QK != EMPTY
    order = jnp.argsort(~nonempty, axis=1, stable=True).astype(jnp.int32)
    return order, nonempty.sum(1).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Per (query block, key block) pair: ``EMPTY``, ``PARTIAL`` or ``FULL`` (see the module
    docstring), with the visiting orders a kernel loops over. A pytree: the tables are
    arrays, the block sizes and lengths static."""

    kind_QK: Any  # [nq, nk] int8
    order_QK: Any  # [nq, nk] int32
    count_Q: Any  # [nq] int32
    order_KQ: Any  # [nk, nq] int32
    count_K: Any  # [nk] int32
    block_q: int = _static(0)
    block_k: int = _static(0)
    T: int = _static(0)  # queries before padding
    S: int = _static(0)  # keys before padding

    @property
    def T_pad(self) -> int:
        return self.kind_QK.shape[0] * self.block_q

    @property
    def S_pad(self) -> int:
        return self.kind_QK.shape[1] * self.block_k

    @property
    def shape(self):
        """``(nq, nk)``: the number of query and key blocks."""
        return self.kind_QK.shape

    @classmethod
    def from_kinds(cls, kind_QK, *, block_q, block_k, T, S):
        """The block mask of a ``[nq, nk]`` table of kinds."""
        kind_QK = jnp.asarray(kind_QK, jnp.int8)
        order_QK, count_Q = _orders(kind_QK)
        order_KQ, count_K = _orders(kind_QK.T)
        return cls(kind_QK, order_QK, count_Q, order_KQ, count_K, block_q, block_k, T, S)

    @classmethod
    def from_spec(cls, spec: MaskSpec | None, T, S, *, block_q, block_k):
        """The block mask of ``spec`` (None: every entry may attend) over ``T`` queries and
        ``S`` keys, with blocks capped at ``T`` and ``S``."""
        tq, tk = _check_blocks(T, S, block_q, block_k)
        T_pad, S_pad = tq * math.ceil(T / tq), tk * math.ceil(S / tk)
        nq, nk = T_pad // tq, S_pad // tk
        if spec is None:
            any_QK = jnp.ones((nq, nk), bool)
            all_QK = any_QK
        else:
            if spec.shape != (T, S):
                raise ValueError(f"MaskSpec covers (T, S)={spec.shape}, the inputs ({T}, {S})")
            padded = spec.padded(T_pad, S_pad)
            any_QK, all_QK = padded.block_any(tq, tk), padded.block_all(tq, tk)
        return cls._build(any_QK, all_QK, tq, tk, T, S)

    @classmethod
    def from_dense(cls, mask, *, block_q, block_k):
        """The block mask of a boolean mask broadcastable to ``[B, N|1, T, S]`` (its last
        two axes must be the full T and S)."""
        mask = jnp.asarray(mask, bool)
        if mask.ndim != 4:
            raise ValueError(f"masks must be 4-D [B, N|1, T, S], got shape {mask.shape}")
        T, S = mask.shape[-2:]
        tq, tk = _check_blocks(T, S, block_q, block_k)
        T_pad, S_pad = tq * math.ceil(T / tq), tk * math.ceil(S / tk)
        nq, nk = T_pad // tq, S_pad // tk

        # Padded queries count neither for ANY nor against ALL; padded keys are masked
        # (``_build`` keeps their block PARTIAL).
        def blocks(q_fill):
            x = jnp.pad(mask, [(0, 0), (0, 0), (0, T_pad - T), (0, 0)], constant_values=q_fill)
            x = jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, S_pad - S)], constant_values=False)
            return x.reshape(-1, nq, tq, nk, tk)

        any_QK = blocks(False).any(axis=(0, 2, 4))
        all_QK = blocks(True).all(axis=(0, 2, 4))
        return cls._build(any_QK, all_QK, tq, tk, T, S)

    @classmethod
    def _build(cls, any_QK, all_QK, tq, tk, T, S):
        if S % tk:  # the last key block holds padded keys, which are masked
            all_QK = all_QK.at[:, -1].set(False)
        kind_QK = jnp.where(all_QK, FULL, jnp.where(any_QK, PARTIAL, EMPTY)).astype(jnp.int8)
        return cls.from_kinds(kind_QK, block_q=tq, block_k=tk, T=T, S=S)

    def counts(self):
        """``{"empty": n, "partial": n, "full": n}`` blocks (concrete tables only)."""
        kinds = jax.device_get(self.kind_QK)
        return {name: int((kinds == k).sum()) for name, k in
                (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}  # fmt: skip


def _check_blocks(T, S, block_q, block_k):
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    return min(block_q, T), min(block_k, S)
