"""Ring-buffer caches: which window a ring serves, where each token's slot is, and the mask
of a call over a ring (see ``attnlab.kv_cache`` for the layout).

A ring of W slots holds position ``p`` in slot ``p % W``, so each row keeps its last W tokens
and memory stops growing with length. It is exact when every self-attention layer of the
decoder slides with the same window W: no query needs an older key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from attnlab import ops
from attnlab.config import ModelConfig
from attnlab.config.architectures import architecture
from attnlab.errors import DecodeError


def ring_window(cfg: ModelConfig) -> int | None:
    """The window W that a ring buffer of W slots serves exactly, or None.

    A ring keeps each row's last W tokens, enough only when every self-attention layer of
    the cached stack is causal and slides with the same window W.
    """
    if not architecture(cfg).generates or not cfg.causal:
        return None
    windows = set(cfg.layer_windows(cfg.stack_layers))
    return None if len(windows) != 1 or None in windows else windows.pop()


def ring_size(cfg: ModelConfig, max_len: int, ring: bool | None) -> int | None:
    """The slots of a ring for ``init_cache``'s ``ring`` argument, or None: a linear cache."""
    window = ring_window(cfg)
    if ring is None:
        return window if window is not None and max_len > window else None
    if ring and window is None:
        raise DecodeError(
            f"ring=True needs every decoder layer to slide with one window, but the layers' "
            f"windows are {cfg.layer_windows(cfg.stack_layers)} (causal={cfg.causal}): set "
            "ModelConfig.sliding_window for every layer, or pass ring=False"
        )
    return window if ring else None


def ring_positions(end_B, slots: int):
    """``[B, slots]``: the position each slot of a ring holds once row ``b`` has seen
    ``end_B[b]`` tokens (the latest ``p < end`` with ``p % slots == s``); negative where
    the slot is still empty."""
    last_B1 = jnp.asarray(end_B, jnp.int32)[:, None] - 1
    return last_B1 - (last_B1 - jnp.arange(slots, dtype=jnp.int32)[None, :]) % slots


def ring_slots(start_B, count_B, T: int, slots: int):
    """``[B, T]``: the ring slot each token of a call goes to, ``p % slots`` for position
    ``p``. Only each row's last ``slots`` real tokens are written (one write per slot, so
    the scatter is deterministic); the others, and padding past ``count_B``, get the
    out-of-range slot ``slots``, which ``scatter`` drops."""
    t_1T = jnp.arange(T, dtype=jnp.int32)[None, :]
    position_BT = start_B[:, None] + t_1T
    keep_BT = (t_1T < count_B[:, None]) & (t_1T >= count_B[:, None] - slots)
    return jnp.where(keep_BT, position_BT % slots, slots)


@struct.dataclass
class Ring:
    """One call of T tokens over a ring-buffer cache: what the stack needs to attend.

    ``start_B``: the tokens each row had seen; ``count_B``: the call's real tokens per row
    (a prefix of its T; only they are stored). A single token is written first and attends
    over the ring in place; a longer call attends over the ring as it was, then its own
    keys, and stores its last ``slots`` real tokens afterwards (``LayerCache.append``).
    """

    start_B: jax.Array
    count_B: jax.Array
    slots: int = struct.field(pytree_node=False)

    def in_place(self, T: int) -> bool:
        return T == 1

    def key_index(self, b, pos, T: int):
        """Where the key at position ``pos`` of row ``b`` lies among the keys a call of
        ``T`` tokens attends over (arrays that broadcast): slot ``pos % slots`` of the ring
        for a single token; for a longer call, the ring's slots, then its own keys from
        ``slots`` on. A variant whose score function reads a per-key array laid out as
        those keys indexes it so (score functions see positions)."""
        ring_slot = pos % self.slots
        if self.in_place(T):
            return ring_slot
        own = pos - self.start_B[b]
        return jnp.where(own >= 0, self.slots + own, ring_slot)

    def keys(self, T: int, windows: tuple):
        """``(k_positions_BS, mask)`` of the keys the call attends over: the mask a
        ``MaskSpec`` over the slots' positions, with the layers' one window."""
        if len(set(windows)) != 1 or windows[0] is None or windows[0] > self.slots:
            raise ValueError(
                f"a ring-buffer cache of {self.slots} slots serves layers that all slide with "
                f"one window of at most {self.slots} keys, but the layers' windows are "
                f"{windows} (ModelConfig.sliding_window / layer_pattern): build the "
                "cache with init_cache(..., ring=False)"
            )
        t_1T = jnp.arange(T, dtype=jnp.int32)[None, :]
        q_BT = self.start_B[:, None] + t_1T
        if self.in_place(T):
            k_BS = ring_positions(self.start_B + self.count_B, self.slots)
        else:
            k_BS = jnp.concatenate([ring_positions(self.start_B, self.slots), q_BT], axis=1)
        mask = ops.MaskSpec(
            q_pos=q_BT, k_pos=k_BS, causal=True, window=jnp.int32(windows[0]), k_valid=k_BS >= 0
        )
        return k_BS, mask
