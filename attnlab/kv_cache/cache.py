"""The cache of a whole model (``KVCache``): its layout from the config, ``init_cache``,
its capacity and size in bytes, and its layers held stacked or apart. The layouts
are described in ``attnlab.kv_cache``."""

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
from attnlab.kv_cache.ring import ring_size
from attnlab.kv_cache.slots import layer_arrays


@struct.dataclass
class KVCache:
    """The decoding cache of a whole model (``attnlab.kv_cache`` describes the layouts).

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
