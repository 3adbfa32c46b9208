"""Boolean attention masks, True = may attend, broadcastable to ``[B, N|1, T, S]``.

Every mask is built from *positions*, so the same functions serve a full forward pass
(queries at 0..T-1 over keys 0..S-1) and a decode step whose queries sit at position ``p``
of a longer cache: pass ``offset=p`` (a scalar, or one offset per batch row, ``[B]``).
Functions that take an offset return ``[1, 1, T, S]`` for a scalar offset and
``[B, 1, T, S]`` for a per-row one. ``combine`` ANDs any number of masks (``None`` = no mask).
"""

from __future__ import annotations

import jax.numpy as jnp


def _query_positions(T, offset):
    """[B|1, T] absolute positions of T queries starting at ``offset``."""
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
