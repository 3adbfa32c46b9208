"""One layer's entries inside the scan over layers (``LayerCache``, what a variant reads and
writes) and the writes into the stacked ``[L, B, *shape]`` arrays: a call's per-token values
scattered into their slots in place (``scatter``, ``write``), and one layer read back
(``layer``). The layouts are described in ``attnlab.kv_cache``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from attnlab.kv_cache.ring import Ring, ring_slots


def scatter(cache_LB, layer, new_BT, slots_BT, slot_axis: int = 1):
    """Writes ``new`` into layer ``layer`` of a per-token entry ``[L, B, *pre, S, *post]``,
    token ``t`` of row ``b`` at slot ``slots_BT[b, t]``; slots past the end are dropped.

    ``new_BT`` is token-major, ``[B, T, *pre, *post]``; ``slot_axis`` is the token axis's
    index in the per-row shape (1: the keys' and values' ``[K, S, H]``). ``layer`` may be
    traced (inside a
    scan over layers). One scatter in the entry's own layout, in place inside a loop.
    """
    L, B = cache_LB.shape[:2]
    pre = cache_LB.shape[2 : 2 + slot_axis]
    S = cache_LB.shape[2 + slot_axis]
    post = cache_LB.shape[3 + slot_axis :]
    P, Q = math.prod(pre), math.prod(post)
    # Scattered as [L * B * P, S, Q] rows, the shape the attention dots read: written in
    # the 5-D shape, XLA:CPU fuses a second copy of the write into each dot's operand, and
    # two writes to one buffer cost a copy of the layer's cache at every decoding step.
    shape_BTP = (*slots_BT.shape, P)
    rows_BTP = jnp.broadcast_to(
        (layer * B + jnp.arange(B)[:, None, None]) * P + jnp.arange(P)[None, None, :], shape_BTP
    )
    slots_BTP = jnp.broadcast_to(slots_BT[..., None], shape_BTP)
    flat = cache_LB.reshape(L * B * P, S, Q)
    new_BTPQ = new_BT.reshape(*slots_BT.shape, P, Q).astype(flat.dtype)
    flat = flat.at[rows_BTP, slots_BTP, :].set(new_BTPQ, mode="drop")
    return flat.reshape(cache_LB.shape)


def write(cache_LB, layer, new_BT, start_B, slot_axis: int = 1):
    """Writes ``new`` into layer ``layer`` of a linear entry, row ``b`` from ``start_B[b]``."""
    T = new_BT.shape[1]
    slots_BT = start_B[:, None] + jnp.arange(T)[None, :]
    return scatter(cache_LB, layer, new_BT, slots_BT, slot_axis)


def layer(cache_LB, index):
    """Layer ``index`` (may be traced) of a stacked cache array: ``[B, ...]``."""
    return jax.lax.dynamic_index_in_dim(cache_LB, index, 0, keepdims=False)


def layer_arrays(x) -> tuple:
    """One ``[1, B, ...]`` array per layer of a stacked array (or of a split one);
    ``jnp.concatenate`` stacks them again."""
    return x if isinstance(x, tuple) else tuple(x[i : i + 1] for i in range(x.shape[0]))


@struct.dataclass
class LayerCache:
    """One layer of the cache inside the scan over layers: what a variant reads and writes.

    A mixer's call receives it as ``MixerCall.cache`` (None without a cache) and returns the
    one its writes produced. It is a value: ``append`` and ``put`` return a new
    ``LayerCache`` and leave this one as it was, so ``call.cache`` stays the cache before
    the call in every step of the call (``docs/variants.md``, "Which cache each step sees").

    ``append(role, new_BT)`` writes a call's per-token values into layer ``index`` (in
    place in the stacked arrays) and returns the entry this call attends over, ``[B, ...]``
    in the entry's own layout: for a linear cache the layer's slots, written from each
    row's ``start_B``; for a ring (``ring``), as ``Ring`` describes. ``read(role)`` is the
    layer's entry as it is, ``put(role, value_B)`` replaces a fixed-size state entry.
    """

    # Role -> the entry's [L, B, *shape] array over the stack's layers (the layer's own
    # [1, B, *shape] when the cache is split); ``read`` and ``append`` pick layer ``index``.
    layers: dict
    index: jax.Array  # int32 scalar: this layer's row of ``layers`` (traced under scan)
    # [B] int32: the tokens each row had seen before this call (``KVCache.lengths``), so
    # the call's first token sits at position ``start_B`` and a linear entry's slot of it.
    start_B: jax.Array
    # [B] int32: this call's real tokens per row (the rest of the T are right padding of a
    # ragged prefill); a state update must take these alone. ``KVCache.lengths`` advances
    # by it after the call.
    count_B: jax.Array
    ring: Ring | None = None  # a ring buffer's slots and where this call writes; None: linear
    # Static: (role, token axis in the per-row shape, None for fixed-size state).
    slot_axes: tuple = struct.field(pytree_node=False, default=())

    def _axis(self, name):
        return dict(self.slot_axes)[name]

    def read(self, name):
        """Entry ``name`` of this layer as this ``LayerCache`` holds it, ``[B, *shape]``:
        on ``call.cache``, the state (or slots) before the call; on the one ``append`` or
        ``put`` returned, with those writes."""
        return layer(self.layers[name], self.index)

    def put(self, name, value_B):
        """A ``LayerCache`` whose fixed-size entry ``name`` holds ``value_B``
        (``[B, *shape]``, cast to the entry's dtype) in this layer; the others unchanged.
        Rows the call does not advance (``count_B`` 0) must be given their old value."""
        x = self.layers[name]
        value = value_B.astype(x.dtype)[None]
        new = jax.lax.dynamic_update_index_in_dim(x, value[0], self.index, 0)
        return self.replace(layers={**self.layers, name: new})

    def key_index(self, b, pos, T: int):
        """Where the key at position ``pos`` of row ``b`` lies in the entry ``append``
        returns to a call of ``T`` tokens (the keys it attends over): its slot ``pos`` in a
        linear cache, ``Ring.key_index`` in a ring. Score functions see positions; a variant
        whose score function reads a per-key array laid out as those keys indexes it so."""
        return pos if self.ring is None else self.ring.key_index(b, pos, T)

    def append(self, name, new_BT):
        """``(cache, entry_B)``: the call's per-token values ``new_BT`` (``[B, T, ...]``,
        token-major) written into per-token entry ``name`` of this layer, and the entry the
        call attends over, in the entry's own layout. Linear: all the layer's slots after the
        write (row ``b``'s tokens in slots ``start_B[b]`` on; slots past each row's length
        hold nothing meaningful and are masked). Ring: the ring after the write for a single
        token, else the ring before it followed by the call's own T values. A fixed-size
        entry is refused (``put`` replaces those)."""
        axis = self._axis(name)
        if axis is None:
            raise ValueError(f"cache entry {name!r} is fixed-size state: replace it with put")
        x, T = self.layers[name], new_BT.shape[1]
        if self.ring is None:
            x = write(x, self.index, new_BT, self.start_B, axis)
            return self._with(name, x), layer(x, self.index)
        ring = self.ring
        slots_BT = ring_slots(ring.start_B, ring.count_B, T, ring.slots)
        before = layer(x, self.index)
        x = scatter(x, self.index, new_BT, slots_BT, axis)
        if ring.in_place(T):
            return self._with(name, x), layer(x, self.index)
        # The ring as it was (read before the write), then the call's own values, laid out
        # as the cache stores them.
        own = jnp.moveaxis(new_BT.astype(x.dtype), 1, 1 + axis)
        return self._with(name, x), jnp.concatenate([before, own], axis=1 + axis)

    def _with(self, name, x):
        return self.replace(layers={**self.layers, name: x})
