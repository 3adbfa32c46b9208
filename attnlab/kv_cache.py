"""The KV cache: an explicit pytree, passed in and returned, never hidden module state.

Layout: keys and values are stacked arrays ``[L, B, K, S, H]`` with a leading layer axis
(the stack's layers scan over it) and only the K key/value heads stored, so GQA/MQA's
saving is real. Each layer's slice is head-major (S inside K): each head's keys are
contiguous, so the attention dots read the cache where it lies; an ``[B, S, K, H]`` cache
would be transposed, whole, at every decode step. ``write`` takes new keys/values in the
model's ``[B, T, K, H]`` order and writes them into one layer, in place.

``lengths[b]`` counts the tokens row ``b`` has seen; its next token sits at position
``lengths[b]``: rows of a ragged batch keep their own lengths and positions. A call of T
tokens may mark each row's real ones (a right-padded prefix, ``valid_BT``); lengths advance
by their number. Encoder-decoder caches also hold the cross-attention keys and values (same
layout), computed once from the encoder output, and the source validity.

Two layouts, told apart by the static field ``window`` (part of the pytree's structure, so
a jitted function compiles one program for each):

* Linear (``window=None``): ``S`` slots, position ``p`` in slot ``p``; a row may hold
  ``capacity = S`` tokens.
* Ring buffer (``window=W``): ``S = W`` slots, position ``p`` in slot ``p % W``, so each row
  keeps its last W tokens and memory stops growing with length; a row may reach
  ``capacity = max_len`` positions (the static field ``max_len``, at most
  ``ModelConfig.max_len``). It is exact when every self-attention layer of the decoder
  slides with the same window W (``ModelConfig.sliding_window``, with
  ``sliding_window_layers`` None or listing every layer): no query needs an older key.
  A slot's position is derived from ``lengths`` (``ring_positions``), for the mask and for
  position biases (ALiBi, relative). ``init_cache(..., ring=None)`` picks a ring whenever
  the config allows one and ``max_len > W``; a model where only some layers slide keeps the
  linear cache (its global layers need every key). A call over a ring (``Ring``) attends in
  one of two ways: a single token is written first and attends over the ring in place (the
  slot it overwrites holds the one key that just left its window); a longer call (a prompt,
  a prefill chunk, possibly longer than W) attends over the ring as it was, then its own
  keys (``[B, W + T]`` keys), and afterwards stores its last W real tokens. Phased loops
  (``truncate``/``paste``) make no sense for a ring and refuse one; row reordering
  (``take_rows``, ``repeat_rows``) works on both.

Chunked prefill (``attnlab.decode.Decoder.prefill``, ``chunk``) feeds a long prompt through
the cache C tokens at a time, so scores are ``[B, N, C, S]`` (``[B, N, C, W + C]`` for a
ring) rather than ``[B, N, T, T]``.

Memory: ``2 * L * B * S * K * H * bytes`` for self-attention (``kv_cache_bytes``), with
``S = W`` for a ring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from attnlab.config import ModelConfig
from attnlab.errors import DecodeError


@struct.dataclass
class KVCache:
    # [L, B, K, S, H]; inside a generation loop over separate blocks, a tuple of L arrays
    # [1, B, K, S, H] (``split_layers``).
    k: jax.Array
    v: jax.Array
    lengths: jax.Array  # [B] int32: tokens seen, the position of the next one
    cross_k: jax.Array | None = None  # [L, B, K, S_src, H]
    cross_v: jax.Array | None = None
    src_valid: jax.Array | None = None  # [B, S_src] bool
    # Static: a ring buffer's window (its slots) and the positions it serves; None: linear.
    window: int | None = struct.field(pytree_node=False, default=None)
    max_len: int | None = struct.field(pytree_node=False, default=None)

    @property
    def ring(self) -> bool:
        return self.window is not None

    @property
    def split(self) -> bool:
        """Whether the layers are held as separate arrays (``split_layers``)."""
        return isinstance(self.k, tuple)

    @property
    def _layer0(self) -> jax.Array:
        return self.k[0] if self.split else self.k

    @property
    def slots(self) -> int:
        """Slots per row and layer (``S``): what the cache stores."""
        return self._layer0.shape[3]

    @property
    def capacity(self) -> int:
        """Tokens a row may hold in all: the slots, or the positions a ring serves."""
        return self.max_len if self.ring else self.slots

    @property
    def batch_size(self) -> int:
        return self._layer0.shape[1]

    @property
    def n_layers(self) -> int:
        return len(self.k) if self.split else self.k.shape[0]


def split_layers(cache: KVCache) -> KVCache:
    """The cache with each layer's keys/values as a separate ``[1, B, K, S, H]`` array.

    For a loop that runs separate blocks (``Stack.unstack``): each block then writes and
    reads its own buffer where it lies, in place, while a block reading its layer of a
    stacked array gets a copy of that layer at every step (XLA's dynamic slice). One copy
    here and one in ``join_layers`` (or none: ``truncate(..., split=True)`` and ``paste``
    split while they copy a prefix anyway), instead of one per layer and step.
    """
    if cache.split:
        return cache
    return cache.replace(k=layer_arrays(cache.k), v=layer_arrays(cache.v))


def join_layers(cache: KVCache) -> KVCache:
    """The stacked cache back from ``split_layers``."""
    if not cache.split:
        return cache
    return cache.replace(k=jnp.concatenate(cache.k), v=jnp.concatenate(cache.v))


def _dtype(cfg: ModelConfig, dtype):
    return jnp.dtype(cfg.dtype if dtype is None else dtype)


def ring_window(cfg: ModelConfig) -> int | None:
    """The window W that a ring buffer of W slots serves exactly, or None.

    A ring keeps each row's last W tokens, enough only when every self-attention layer of
    the cached stack is causal and slides with the same window W.
    """
    if cfg.arch == "encoder" or not cfg.causal:
        return None
    windows = set(cfg.layer_windows(cfg.stack_layers))
    return None if len(windows) != 1 or None in windows else windows.pop()


def _ring_slots(cfg: ModelConfig, max_len: int, ring: bool | None) -> int | None:
    """The ring's slots for ``init_cache``'s ``ring`` argument, or None for a linear cache."""
    window = ring_window(cfg)
    if ring is None:
        return window if window is not None and max_len > window else None
    if ring and window is None:
        raise DecodeError(
            f"ring=True needs every decoder layer to slide with one window, but "
            f"ModelConfig.sliding_window={cfg.sliding_window}, sliding_window_layers="
            f"{cfg.sliding_window_layers}, causal={cfg.causal}: set sliding_window and leave "
            "sliding_window_layers None (or list every layer), or pass ring=False"
        )
    return window if ring else None


def init_cache(
    cfg: ModelConfig, batch_size: int, max_len: int, dtype=None, *, ring: bool | None = None
) -> KVCache:
    """An empty cache for ``batch_size`` rows of up to ``max_len`` tokens.

    ``ring``: a ring buffer of ``ModelConfig.sliding_window`` slots (True), a linear cache
    of ``max_len`` slots (False), or a ring whenever the config allows one and ``max_len``
    exceeds the window (None).
    """
    if cfg.arch == "encoder":
        raise ValueError("ModelConfig.arch='encoder' has no causal decoder: nothing to cache")
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
    window = _ring_slots(cfg, max_len, ring)
    slots = max_len if window is None else window
    shape = (cfg.stack_layers, batch_size, cfg.n_kv_heads, slots, cfg.head_dim)
    dt = _dtype(cfg, dtype)
    # Two buffers (not one shared zeros): a jitted step may then donate the cache.
    return KVCache(
        k=jnp.zeros(shape, dt),
        v=jnp.zeros(shape, dt),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        window=window,
        max_len=None if window is None else max_len,
    )


def scatter(cache_LBKSH, layer, new_BTKH, slots_BT):
    """Writes ``new`` into layer ``layer`` of the cache, token ``t`` of row ``b`` at slot
    ``slots_BT[b, t]``; slots past the end are dropped.

    ``layer`` may be traced (inside a scan over layers). One scatter in the cache's own
    layout, in place inside a loop.
    """
    L, B, K, S, H = cache_LBKSH.shape
    # Scattered as [L * B * K, S, H] rows, the shape the attention dots read: written in
    # the 5-D shape, XLA:CPU fuses a second copy of the write into each dot's operand, and
    # two writes to one buffer cost a copy of the layer's cache at every decoding step.
    shape_BTK = (*slots_BT.shape, K)
    rows_BTK = jnp.broadcast_to(
        (layer * B + jnp.arange(B)[:, None, None]) * K + jnp.arange(K)[None, None, :], shape_BTK
    )
    slots_BTK = jnp.broadcast_to(slots_BT[..., None], shape_BTK)
    flat = cache_LBKSH.reshape(L * B * K, S, H)
    flat = flat.at[rows_BTK, slots_BTK, :].set(new_BTKH.astype(flat.dtype), mode="drop")
    return flat.reshape(L, B, K, S, H)


def write(cache_LBKSH, layer, new_BTKH, start_B):
    """Writes ``new`` into layer ``layer`` of a linear cache, row ``b`` from ``start_B[b]``."""
    T = new_BTKH.shape[1]
    return scatter(cache_LBKSH, layer, new_BTKH, start_B[:, None] + jnp.arange(T)[None, :])


def layer(cache_LBKSH, index):
    """Layer ``index`` (may be traced) of a stacked cache array: ``[B, K, S, H]``."""
    return jax.lax.dynamic_index_in_dim(cache_LBKSH, index, 0, keepdims=False)


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
    keys, and stores its last ``slots`` real tokens afterwards (``LayerView.append``).
    """

    start_B: jax.Array
    count_B: jax.Array
    slots: int = struct.field(pytree_node=False)

    def in_place(self, T: int) -> bool:
        return T == 1

    def keys(self, T: int, windows: tuple):
        """``(k_positions_BS, mask_B1TS)`` of the keys the call attends over, with the
        layers' ``windows`` (one window for all, at most ``slots``) in the mask."""
        if len(set(windows)) != 1 or windows[0] is None or windows[0] > self.slots:
            raise ValueError(
                f"a ring-buffer cache of {self.slots} slots serves layers that all slide with "
                f"one window of at most {self.slots} keys, but the layers' windows are "
                f"{windows} (ModelConfig.sliding_window / sliding_window_layers): build the "
                "cache with init_cache(..., ring=False)"
            )
        t_1T = jnp.arange(T, dtype=jnp.int32)[None, :]
        q_BT = self.start_B[:, None] + t_1T  # the mask lives in slot positions, as a linear one
        if self.in_place(T):
            k_BS = ring_positions(self.start_B + self.count_B, self.slots)
        else:
            k_BS = jnp.concatenate([ring_positions(self.start_B, self.slots), q_BT], axis=1)
        q_BT1, k_B1S = q_BT[:, :, None], k_BS[:, None, :]
        mask_BTS = (k_B1S >= 0) & (k_B1S <= q_BT1) & (k_B1S > q_BT1 - windows[0])
        return k_BS, mask_BTS[:, None]


def _refuse_ring(cache: KVCache, what: str):
    if cache.ring:
        raise ValueError(
            f"{what} cuts a linear cache by slots, but this cache is a ring buffer "
            f"(KVCache.window={cache.window}) whose slots are not positions: run the loop "
            "without phases, or build the cache with init_cache(..., ring=False)"
        )


def truncate(cache: KVCache, size: int, *, split: bool = False) -> KVCache:
    """The cache cut to its first ``size`` slots (a copy; cross-attention is left as is);
    ``split``: cut into one array per layer as well (``split_layers``), in the same copy."""
    _refuse_ring(cache, "truncate")
    if split or cache.split:
        cut = lambda x: tuple(a[:, :, :, :size] for a in layer_arrays(x))
        return cache.replace(k=cut(cache.k), v=cut(cache.v))
    cut = lambda x: x[:, :, :, :size]
    return cache.replace(k=cut(cache.k), v=cut(cache.v))


def layer_arrays(x) -> tuple:
    """One ``[1, B, K, S, H]`` array per layer of a stacked array (or of a split one);
    ``jnp.concatenate`` stacks them again."""
    return x if isinstance(x, tuple) else tuple(x[i : i + 1] for i in range(x.shape[0]))


def paste(full: KVCache, part: KVCache) -> KVCache:
    """``part`` (from ``truncate``, split or not) written back over the first slots of
    ``full``; the result is laid out as ``full``."""
    _refuse_ring(full, "paste")
    put = lambda f, p, i=0: jax.lax.dynamic_update_slice(f, p, (i,) + (0,) * (f.ndim - 1))

    def paste_one(f, p):
        if isinstance(f, tuple):  # split into split
            return tuple(put(a, b) for a, b in zip(f, layer_arrays(p), strict=True))
        if isinstance(p, tuple):  # each layer's part into the stacked array
            for i, b in enumerate(p):
                f = put(f, b, i)
            return f
        return put(f, p)

    return part.replace(k=paste_one(full.k, part.k), v=paste_one(full.v, part.v))


def repeat_rows(cache: KVCache, n: int) -> KVCache:
    """Each row repeated ``n`` times in place (row ``b`` becomes rows ``b*n .. b*n+n-1``)."""
    per_layer = lambda x: jax.tree.map(lambda a: jnp.repeat(a, n, axis=1), x)
    per_row = lambda x: None if x is None else jnp.repeat(x, n, axis=0)
    return cache.replace(
        k=per_layer(cache.k),
        v=per_layer(cache.v),
        lengths=per_row(cache.lengths),
        cross_k=per_layer(cache.cross_k),
        cross_v=per_layer(cache.cross_v),
        src_valid=per_row(cache.src_valid),
    )


def take_rows(cache: KVCache, rows_B) -> KVCache:
    """The self-attention rows ``rows_B`` (beam reordering); cross-attention is left as is,
    so ``rows_B`` must map each row to a row of the same source. A ring's slot positions
    follow each row's length, so its rows move as they are."""
    take = lambda x: jax.tree.map(lambda a: jnp.take(a, rows_B, axis=1), x)
    return cache.replace(
        k=take(cache.k),
        v=take(cache.v),
        lengths=jnp.take(cache.lengths, rows_B, axis=0),
    )


def kv_cache_bytes(
    cfg: ModelConfig, batch_size: int, max_len: int, dtype="bfloat16", *, ring: bool | None = None
) -> int:
    """Bytes of the self-attention cache ``init_cache`` builds with the same arguments:
    2 * L * B * S * K * H * itemsize, with S the window for a ring buffer."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"kv_cache_bytes takes a ModelConfig, got {type(cfg).__name__}; convert a Hugging "
            "Face config with attnlab.pretrained.model_config_from_hf"
        )
    itemsize = jnp.dtype(dtype).itemsize
    window = _ring_slots(cfg, max_len, ring)
    L, K, H, S = cfg.stack_layers, cfg.n_kv_heads, cfg.head_dim, window or max_len
    return 2 * L * batch_size * S * K * H * itemsize


@struct.dataclass
class LayerView:
    """One layer of a stacked cache inside the scan over layers.

    ``append`` writes a call's keys/values into layer ``index`` (in place in the stacked
    arrays) and returns the keys/values ``[B, S, K, H]`` to attend over: for a linear cache
    the layer's slots, written from each row's ``start_B``; for a ring (``ring``) those of
    ``Ring.keys``. The swap of S and K is folded into the attention dots by XLA.
    """

    k: jax.Array  # [L, B, K, S, H]
    v: jax.Array
    index: jax.Array  # int32 scalar (traced under scan)
    start_B: jax.Array
    ring: Ring | None = None

    def _layer_BSKH(self, x):
        return jnp.swapaxes(layer(x, self.index), 1, 2)

    def append(self, k_BTKH, v_BTKH):
        if self.ring is not None:
            return self._append_ring(k_BTKH, v_BTKH)
        k = write(self.k, self.index, k_BTKH, self.start_B)
        v = write(self.v, self.index, v_BTKH, self.start_B)
        return self.replace(k=k, v=v), self._layer_BSKH(k), self._layer_BSKH(v)

    def _append_ring(self, k_BTKH, v_BTKH):
        ring, T = self.ring, k_BTKH.shape[1]
        slots_BT = ring_slots(ring.start_B, ring.count_B, T, ring.slots)
        k = scatter(self.k, self.index, k_BTKH, slots_BT)
        v = scatter(self.v, self.index, v_BTKH, slots_BT)
        if ring.in_place(T):
            return self.replace(k=k, v=v), self._layer_BSKH(k), self._layer_BSKH(v)
        # The ring as it was (read before the write), then the call's own keys, stored as
        # the cache stores them.
        before = lambda x, new: jnp.concatenate([self._layer_BSKH(x), new.astype(x.dtype)], axis=1)
        return self.replace(k=k, v=v), before(self.k, k_BTKH), before(self.v, v_BTKH)
