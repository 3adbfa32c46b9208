"""What the sharded attention paths share: the mesh axes an array's batch or heads split over,
and, for a sequence split over devices (context parallelism), the rules one device applies
(``Rules``), the mask of one (query chunk, key chunk) pair evaluated from the chunks'
metadata, keys that vary over the mesh's manual axes, dropout keys folded per chunk, and the
shape check of q/k/v.

A chunk's metadata is a dict of ``[B|1, T]`` arrays: ``"pos"`` (positions, always),
``"segment"`` (packed documents' ids), ``"valid"`` (keys only: real keys) and ``"index"``
(the tokens' indices a score function reads; default: the positions)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnlab.ops.linear import fold as fold_key  # noqa: F401 (its old name here)


def fit_axes(mesh, axes, size, taken=()) -> tuple[str, ...]:
    """The axes among ``axes`` (larger than 1, not ``taken``) that evenly split ``size``:
    greedily, as ``sharding.constrain`` places an activation."""
    out = []
    for axis in axes:
        if axis not in mesh.shape or axis in taken or mesh.shape[axis] == 1:
            continue
        if size % (math.prod(mesh.shape[a] for a in out) * mesh.shape[axis]) == 0:
            out.append(axis)
    return tuple(out)


def spec_axes(axes):
    """A ``PartitionSpec`` entry for ``axes``: None, one axis, or a tuple of them."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def chunk_mask(
    q_pos_BT,
    k_pos_BS,
    *,
    causal=False,
    window=None,
    q_segment_BT=None,
    k_segment_BS=None,
    k_valid_BS=None,
):
    """``[B|1, 1, T, S]`` mask (True = may attend) of queries and keys at the given
    positions, or None when no rule applies.

    ``causal``: ``k <= q``; ``window`` (int or traced scalar): ``q - window < k <= q``, as
    ``masks.sliding_window`` (it implies causal); segments: equal non-zero ids, as
    ``masks.segment``; ``k_valid_BS``: real keys, as ``masks.padding``.
    """
    if (q_segment_BT is None) != (k_segment_BS is None):
        raise ValueError("chunk_mask: give both q_segment_BT and k_segment_BS, or neither")
    mask_BTS = None

    def both(a, b):
        return b if a is None else a & b

    if causal or window is not None:
        d_BTS = jnp.asarray(q_pos_BT)[:, :, None] - jnp.asarray(k_pos_BS)[:, None, :]
        mask_BTS = d_BTS >= 0
        if window is not None:
            mask_BTS = mask_BTS & (d_BTS < jnp.asarray(window, d_BTS.dtype))
    if q_segment_BT is not None:
        q_BT1, k_B1S = q_segment_BT[:, :, None], k_segment_BS[:, None, :]
        mask_BTS = both(mask_BTS, (q_BT1 == k_B1S) & (q_BT1 > 0) & (k_B1S > 0))
    if k_valid_BS is not None:
        mask_BTS = both(mask_BTS, jnp.asarray(k_valid_BS, bool)[:, None, :])
    return None if mask_BTS is None else mask_BTS[:, None]


@dataclasses.dataclass(frozen=True)
class Rules:
    """What one device's attention over the chunks applies besides q, k, v and their
    metadata; the arguments of ``context_parallel_attention`` of the same names, as one
    device sees them (``window`` may be traced; ``bias_fn(q_pos_BT, k_pos_BS)``).
    ``load_balance``: the chunks are zigzag pairs (``attnlab.ops.context_parallel``)."""

    causal: bool = False
    window: Any = None
    bias_fn: Callable | None = None
    score_mod: Callable | None = None
    scale: float | None = None
    axis_name: str = "context"
    load_balance: bool = True
    dropout_rate: float = 0.0
    dropout_key: Any = None


def meta_mask(q_meta, k_meta, causal, window):
    """``chunk_mask`` of two chunks' metadata."""
    return chunk_mask(
        q_meta["pos"],
        k_meta["pos"],
        causal=causal,
        window=window,
        q_segment_BT=q_meta.get("segment"),
        k_segment_BS=k_meta.get("segment"),
        k_valid_BS=k_meta.get("valid"),
    )


def full_meta(meta, L, score_mod):
    """A chunk's metadata with its positions and indices ``[B|1, L]``; without a
    ``score_mod``, no indices (nothing reads them)."""
    keep = {k: x for k, x in meta.items() if k != "index" or score_mod is not None}
    rows = lambda k, x: jnp.broadcast_to(x, (x.shape[0], L)) if k in ("pos", "index") else x
    return {k: rows(k, x) for k, x in keep.items()}


def vary_like(x, like):
    """``x`` varying over every manual mesh axis that ``like`` varies over (inside
    ``shard_map``; unchanged outside it or without float values)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _varying(x) -> set:
    """The manual mesh axes ``x`` varies over (its type's varying-axes set)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)  # JAX 0.10; earlier releases: ``vma``
    return set(kind.varying if kind is not None else getattr(aval, "vma", ()))


def prepare(q_BTNH, k_BSKH, v_BSKH, scale):
    """``((B, T, N, H, K, G), scale)`` after checking the q/k/v shapes (``scale`` None:
    ``H ** -0.5``)."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if k_BSKH.shape != v_BSKH.shape or N % K or k_BSKH.shape[3] != H:
        raise ValueError(
            f"context-parallel attention expects q [B, T, N, H] and k, v [B, S, K, H] with K "
            f"dividing N; got q={q_BTNH.shape}, k={k_BSKH.shape}, v={v_BSKH.shape}"
        )
    return (B, T, N, H, K, N // K), H**-0.5 if scale is None else scale
