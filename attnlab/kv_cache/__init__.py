"""The decoding cache: an explicit pytree, passed in and returned, never hidden module state.

One contract for every variant (``attnlab.contracts.mixer``). A variant declares its entries by role
(``CacheEntry``): per-token entries (keys, values, a compressed latent) with a token axis,
and fixed-size state (a recurrent or convolution state) without one. The cache holds each
role as one stacked array ``[L, B, *shape]`` with a leading layer axis (the stack's layers
scan over it), in ``KVCache.layers``. A hybrid stack (``ModelConfig.block_pattern``) holds
one array per mixer and role, ``"<mixer>.<role>"`` ``[n, B, *shape]`` over the ``n`` layers
that run that mixer (``cache_layout``, ``attnlab.config.layer_kinds``). The built-in attention
keeps ``"keys"`` and ``"values"`` as ``[L, B, K, S, H]``: only the K key/value heads
(GQA/MQA's saving is real), head-major (S inside K), so each head's keys are contiguous and
the attention dots read the cache where it lies. Per-token values arrive in token-major
order (``[B, T, ...]``, the shape without the token axis after ``T``) and are scattered into
their slots in place.

``lengths[b]`` counts the tokens row ``b`` has seen; its next token sits at position
``lengths[b]``: rows of a ragged batch keep their own lengths and positions. A call of T
tokens may mark each row's real ones (a right-padded prefix, ``valid_BT``); lengths advance
by their number. Encoder-decoder caches also hold the cross-attention keys and values
(``cross``, same layout), computed once from the encoder output, and the source validity.

Two layouts of the per-token entries, told apart by the static field ``window`` (part of
the pytree's structure, so a jitted function compiles one program for each):

* Linear (``window=None``): ``S`` slots, position ``p`` in slot ``p``; a row may hold
  ``capacity = S`` tokens.
* Ring buffer (``window=W``): ``S = W`` slots, position ``p`` in slot ``p % W``, so each row
  keeps its last W tokens and memory stops growing with length; a row may reach
  ``capacity = max_len`` positions. It is exact when every self-attention layer of the
  decoder slides with the same window W (``ModelConfig.layer_windows``): no query needs an
  older key. A slot's position is derived from ``lengths`` (``ring_positions``), for the
  mask and for position biases. ``init_cache(..., ring=None)`` picks a ring whenever the
  config allows one and ``max_len > W``. A call over a ring (``Ring``) attends in one of two
  ways: a single token is written first and attends over the ring in place (the slot it
  overwrites holds the one key that just left its window); a longer call attends over the
  ring as it was, then its own entries (``W + T`` tokens), and afterwards stores its last W
  real tokens. Phased loops (``truncate``/``paste``) make no sense for a ring and refuse
  one; row reordering (``take_rows``, ``repeat_rows``) works on both.

Memory: the sum over entries of ``L * B * prod(shape) * itemsize`` (``kv_cache_bytes``),
``2 * L * B * S * K * H * itemsize`` for the built-in attention, with ``S = W`` for a ring.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from attnlab.config import ModelConfig
from attnlab.config.architectures import architecture
from attnlab.config.layer_kinds import stack_plan
from attnlab.contracts.mixer import CacheEntry
from attnlab.errors import DecodeError, traced_check
from attnlab.kv_cache.ring import (  # noqa: F401 - the ring's names, where callers look for them
    Ring,
    ring_positions,
    ring_size,
    ring_slots,
    ring_window,
)


@struct.dataclass
class KVCache:
    """The decoding cache of a whole model (see the module docstring for the layouts).

    ``layers`` maps each role the variant declares to its stacked ``[L, B, *shape]``
    array; ``lengths`` ``[B]`` counts the tokens each row has seen; ``cross`` and
    ``src_valid`` hold an encoder-decoder's cross-attention keys, values and source
    validity. ``window`` (static) is a ring buffer's slot count, None for a linear cache.
    """

    # Role -> [L, B, *shape]; inside a generation loop over separate blocks, a tuple of L
    # arrays [1, B, *shape] (``split_layers``).
    layers: dict
    lengths: jax.Array  # [B] int32: tokens seen, the position of the next one
    cross: dict | None = None  # {"keys", "values"}: [L, B, K, S_src, H]
    src_valid: jax.Array | None = None  # [B, S_src] bool
    # Static: each role's token axis in its per-row shape (None: fixed-size state), a ring
    # buffer's window (its slots; None: linear) and the positions the cache serves.
    slot_axes: tuple = struct.field(pytree_node=False, default=())
    window: int | None = struct.field(pytree_node=False, default=None)
    max_len: int | None = struct.field(pytree_node=False, default=None)

    @property
    def k(self):
        """The built-in attention's keys (``layers["keys"]``)."""
        return self.layers["keys"]

    @property
    def v(self):
        """The ``\"values\"`` entry, ``[L, B, K, S, H]``."""
        return self.layers["values"]

    @property
    def ring(self) -> bool:
        """Whether the per-token entries are a ring buffer of ``window`` slots."""
        return self.window is not None

    @property
    def split(self) -> bool:
        """Whether the layers are held as separate arrays (``split_layers``)."""
        return isinstance(next(iter(self.layers.values())), tuple)

    def _first(self, per_token: bool):
        for name, axis in self.slot_axes:
            if (axis is not None) == per_token:
                x = self.layers[name]
                return (x[0] if isinstance(x, tuple) else x), axis
        return None, None

    @property
    def slots(self) -> int | None:
        """Slots per row and layer (``S``) of the per-token entries; None without any."""
        x, axis = self._first(True)
        return None if x is None else x.shape[2 + axis]

    @property
    def capacity(self) -> int:
        """Tokens a row may hold in all: the slots, or the positions a ring (or a cache of
        fixed-size state alone) serves."""
        slots = self.slots
        return self.max_len if self.ring or slots is None else slots

    @property
    def overflow(self) -> jax.Array:
        """``[B]`` bool: rows asked to hold more tokens than a linear cache's ``capacity``.

        ``lengths`` keeps counting past the capacity while the writes past it are dropped,
        so such a row's logits from its ``capacity``-th token on are wrong, and the flag
        stays set. Under ``jit``, where a call cannot raise, it is the one sign of a write
        past the end (``check_capacity`` turns it into the error). A ring never overflows.
        """
        if self.ring or self.slots is None:
            return jnp.zeros(self.lengths.shape, bool)
        return self.lengths > self.capacity

    @property
    def batch_size(self) -> int:
        """B, the number of rows."""
        return self.lengths.shape[0]

    @property
    def n_layers(self) -> int:
        """The layers that stack the first entry: L in a homogeneous cache (in a hybrid one,
        each entry's leading axis counts the layers of its mixer, ``cache_layout``)."""
        x = next(iter(self.layers.values()))
        return len(x) if isinstance(x, tuple) else x.shape[0]

    @property
    def per_token(self) -> tuple[tuple[str, int], ...]:
        """``(role, token axis)`` of the per-token entries."""
        return tuple((n, a) for n, a in self.slot_axes if a is not None)


def _map_layers(cache: KVCache, fn) -> dict:
    return {name: fn(name, axis, cache.layers[name]) for name, axis in cache.slot_axes}


def split_layers(cache: KVCache) -> KVCache:
    """The cache with each layer's entries as separate ``[1, B, ...]`` arrays.

    For a loop that runs separate blocks (``Stack.unstack``): each block then writes and
    reads its own buffer where it lies, in place, while a block reading its layer of a
    stacked array gets a copy of that layer at every step (XLA's dynamic slice). One copy
    here and one in ``join_layers`` (or none: ``truncate(..., split=True)`` and ``paste``
    split while they copy a prefix anyway), instead of one per layer and step.
    """
    if cache.split:
        return cache
    return cache.replace(layers=_map_layers(cache, lambda n, a, x: layer_arrays(x)))


def join_layers(cache: KVCache) -> KVCache:
    """The stacked cache back from ``split_layers``."""
    if not cache.split:
        return cache
    return cache.replace(layers=_map_layers(cache, lambda n, a, x: jnp.concatenate(x)))


def cache_layout(cfg: ModelConfig) -> dict[str, tuple[CacheEntry, int]]:
    """Each entry of the decoder's cache by name: what one layer keeps
    (``Mixer.cache_entries``) and how many layers stack it. A homogeneous stack names its
    entries by role, every layer stacked (``[L, ...]``); a hybrid one
    ``"<mixer>.<role>"``, over the layers that run that mixer (``attnlab.config.layer_kinds``)."""
    return stack_plan(cfg, cfg.stack_layers).cache_layout(cfg)


def cache_entries(cfg: ModelConfig) -> dict[str, CacheEntry]:
    """What the configured variants keep per layer, by the cache's entry names."""
    return {name: entry for name, (entry, _) in cache_layout(cfg).items()}


def entry_dtype(entry: CacheEntry, dtype) -> jnp.dtype:
    """An entry's own dtype (a recurrent state's float32), else the cache's ``dtype``; a
    float64 cache keeps every entry in float64, so a float64 model decodes in float64."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype == jnp.float64 else jnp.dtype(entry.dtype or dtype)


def init_cache(
    cfg: ModelConfig, batch_size: int, max_len: int, dtype=None, *, ring: bool | None = None
) -> KVCache:
    """An empty cache for ``batch_size`` rows of up to ``max_len`` tokens.

    ``ring``: a ring buffer of ``ModelConfig.sliding_window`` slots (True), a linear cache
    of ``max_len`` slots (False), or a ring whenever the config allows one and ``max_len``
    exceeds the window (None). ``dtype`` is that of entries that do not name their own.
    """
    if not architecture(cfg).generates:
        raise ValueError(f"ModelConfig.arch={cfg.arch!r} has no causal decoder: nothing to cache")
    if max_len > cfg.max_len:
        raise ValueError(
            f"cache max_len={max_len} exceeds ModelConfig.max_len={cfg.max_len}: the model has "
            "no positions beyond it; ask for a shorter cache or a model with a larger max_len"
        )
    if max_len < 1 or batch_size < 1:
        raise ValueError(
            f"init_cache needs batch_size >= 1 and max_len >= 1, got "
            f"batch_size={batch_size}, max_len={max_len}"
        )
    window = ring_size(cfg, max_len, ring)
    slots = max_len if window is None else window
    default = jnp.dtype(cfg.dtype if dtype is None else dtype)
    layout = cache_layout(cfg)
    # One buffer per entry (not a shared zeros): a jitted step may then donate the cache.
    layers = {
        name: jnp.zeros((n, batch_size, *e.sized(slots)), entry_dtype(e, default))
        for name, (e, n) in layout.items()
    }
    return KVCache(
        layers=layers,
        lengths=jnp.zeros((batch_size,), jnp.int32),
        slot_axes=tuple((name, e.slot_axis) for name, (e, _) in layout.items()),
        window=window,
        max_len=max_len,
    )


def check_capacity(cache: KVCache, new_B=0) -> None:
    """Raises a ``DecodeError`` if a row of a linear cache would hold more than its
    ``capacity`` once ``new_B`` more tokens (an int, or ``[B]`` per row) are appended.

    Model calls check their tokens with it before the first write; ``check_capacity(cache)``
    after a jitted loop reports the rows whose writes went past the end (``overflow``).
    Nothing to check for a ring (it wraps by design). Traced values cannot raise: inside
    ``attnlab.decode.checks.checked_jit`` they are a ``checkify`` check that raises this error
    after the call (``attnlab.errors.traced_check``); elsewhere nothing is added to the
    program, and the returned cache's ``overflow`` flags the rows.
    """
    if cache.ring or cache.slots is None:
        return
    if any(isinstance(x, jax.core.Tracer) for x in (cache.lengths, new_B)):
        need = lambda: jnp.max(cache.lengths + jnp.asarray(new_B, jnp.int32))
        traced_check(
            lambda: need() <= cache.capacity,
            f"the cache holds {cache.capacity} tokens per row but a row asks for {{need}} "
            "(under jit: the writes past the end are dropped and its logits are wrong): "
            "pass a larger max_len to init_cache, or use a ring cache (init_cache(..., "
            "ring=True)) for a sliding-window model",
            need=need,
        )
        return
    held_B = np.asarray(cache.lengths)
    need_B = held_B + np.asarray(new_B)
    if (need_B > cache.capacity).any():
        b = int(np.argmax(need_B))
        raise DecodeError(
            f"the cache holds {cache.capacity} tokens per row but row {b} asks for "
            f"{int(need_B[b])} ({int(held_B[b])} held + {int(need_B[b] - held_B[b])} new): "
            "pass a larger max_len to init_cache, or use a ring cache (init_cache(..., "
            "ring=True)) for a sliding-window model"
        )


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


def _refuse_ring(cache: KVCache, what: str):
    if cache.ring:
        raise ValueError(
            f"{what} cuts a linear cache by slots, but this cache is a ring buffer "
            f"(KVCache.window={cache.window}) whose slots are not positions: run the loop "
            "without phases, or build the cache with init_cache(..., ring=False)"
        )


def layer_arrays(x) -> tuple:
    """One ``[1, B, ...]`` array per layer of a stacked array (or of a split one);
    ``jnp.concatenate`` stacks them again."""
    return x if isinstance(x, tuple) else tuple(x[i : i + 1] for i in range(x.shape[0]))


def truncate(cache: KVCache, size: int, *, split: bool = False) -> KVCache:
    """The cache with its per-token entries cut to their first ``size`` slots (a copy;
    state and cross-attention are left as they are); ``split``: cut into one array per
    layer as well (``split_layers``), in the same copy."""
    _refuse_ring(cache, "truncate")

    def cut(name, axis, x):
        per_layer = split or cache.split
        if axis is None:
            return layer_arrays(x) if per_layer else x
        trim = lambda a: jax.lax.slice_in_dim(a, 0, size, axis=2 + axis)
        return tuple(trim(a) for a in layer_arrays(x)) if per_layer else trim(x)

    return cache.replace(layers=_map_layers(cache, cut))


def paste(full: KVCache, part: KVCache) -> KVCache:
    """``part`` (from ``truncate``, split or not) written back over the first slots of
    ``full``; the result is laid out as ``full``."""
    _refuse_ring(full, "paste")
    put = lambda f, p, i=0: jax.lax.dynamic_update_slice(f, p, (i,) + (0,) * (f.ndim - 1))

    def paste_one(name, axis, f):
        p = part.layers[name]
        if isinstance(f, tuple):  # split into split
            return tuple(put(a, b) for a, b in zip(f, layer_arrays(p), strict=True))
        if isinstance(p, tuple):  # each layer's part into the stacked array
            for i, b in enumerate(p):
                f = put(f, b, i)
            return f
        return put(f, p)

    return part.replace(layers=_map_layers(full, paste_one))


def repeat_rows(cache: KVCache, n: int) -> KVCache:
    """Each row repeated ``n`` times in place (row ``b`` becomes rows ``b*n .. b*n+n-1``)."""
    per_layer = lambda x: jax.tree.map(lambda a: jnp.repeat(a, n, axis=1), x)
    per_row = lambda x: None if x is None else jnp.repeat(x, n, axis=0)
    return cache.replace(
        layers=per_layer(cache.layers),
        lengths=per_row(cache.lengths),
        cross=per_layer(cache.cross),
        src_valid=per_row(cache.src_valid),
    )


def take_rows(cache: KVCache, rows_B) -> KVCache:
    """The self-attention rows ``rows_B`` (beam reordering); cross-attention is left as is,
    so ``rows_B`` must map each row to a row of the same source. A ring's slot positions
    follow each row's length, so its rows move as they are."""
    take = lambda x: jax.tree.map(lambda a: jnp.take(a, rows_B, axis=1), x)
    return cache.replace(layers=take(cache.layers), lengths=jnp.take(cache.lengths, rows_B, axis=0))


def kv_cache_bytes(
    cfg: ModelConfig, batch_size: int, max_len: int, dtype="bfloat16", *, ring: bool | None = None
) -> int:
    """Bytes of the self-attention cache ``init_cache`` builds with the same arguments, from
    the config alone: the variants' entries, ``n * B * prod(shape) * itemsize`` each for the
    ``n`` layers that keep it (entries without their own dtype in ``dtype``), with S the
    window for a ring buffer."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"kv_cache_bytes takes a ModelConfig, got {type(cfg).__name__}; convert a Hugging "
            "Face config with attnlab.pretrained.model_config_from_hf"
        )
    window = ring_size(cfg, max_len, ring)
    slots = window or max_len
    return sum(
        n * batch_size * math.prod(e.sized(slots)) * entry_dtype(e, dtype).itemsize
        for e, n in cache_layout(cfg).values()
    )


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
