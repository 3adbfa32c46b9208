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
from attnlab.errors import DecodeError, checking_traced, traced_check
from attnlab.kv_cache.ring import ring_size
from attnlab.kv_cache.slots import layer_arrays
from attnlab.ops import paths

# What a traced call that writes past a linear cache's capacity does (``init_cache``).
ON_OVERFLOW = ("raise", "flag")


@struct.dataclass
class KVCache:
    """The decoding cache of a whole model (``attnlab.kv_cache`` describes the layouts).

    ``layers`` maps each role the variant declares to its stacked ``[L, B, *shape]``
    array; ``lengths`` ``[B]`` counts the tokens each row has seen; ``cross`` and
    ``src_valid`` hold an encoder-decoder's cross-attention keys, values and source
    validity. ``window`` (static) is a ring buffer's slot count, None for a linear cache;
    ``on_overflow`` (static) what a traced write past a linear cache's capacity does
    (``init_cache``).
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
    on_overflow: str = struct.field(pytree_node=False, default="raise")

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
        stays set. It is the one sign of a write past the end under ``jit`` with
        ``on_overflow="flag"`` (``check_capacity`` turns it into the error); with
        ``"raise"`` such a call raises. A ring never overflows.
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
    cfg: ModelConfig,
    batch_size: int,
    max_len: int,
    dtype=None,
    *,
    ring: bool | None = None,
    on_overflow: str = "raise",
) -> KVCache:
    """An empty cache for ``batch_size`` rows of up to ``max_len`` tokens.

    ``ring``: a ring buffer of ``ModelConfig.sliding_window`` slots (True), a linear cache
    of ``max_len`` slots (False), or a ring whenever the config allows one and ``max_len``
    exceeds the window (None). ``dtype`` is that of entries that do not name their own.

    ``on_overflow``: what a call traced under ``jit`` (a hand-written ``nnx.jit`` or
    ``jax.jit`` decoding loop) does when it writes past a linear cache's capacity. An eager
    call raises a ``DecodeError`` before any write either way, and so does a call through
    ``attnlab.decode.checks.checked_jit``; a ring never overflows.

    * ``"raise"`` (the default): the call raises when it runs. The program tests the new
      lengths against the capacity and only then calls back to the host
      (``raise_on_overflow``): nothing leaves the device otherwise, and the error JAX raises
      (``JaxRuntimeError``, or a ``ValueError``) ends with the ``DecodeError`` line. On
      XLA:CPU a program holding a host callback runs to its end inside the call, which
      ``benchmarks/runtime_checks.py`` measures (about 0.1 ms a step on a small model).
    * ``"flag"``: nothing is added to the program; the writes past the end are dropped and
      the returned cache's ``overflow`` flags the rows (``check_capacity`` raises on it).
      For programs lowered for another platform or exported, which cannot hold a host
      callback, and for loops that check the capacity on the host (``generate``).
    """
    if on_overflow not in ON_OVERFLOW:
        raise ValueError(
            f"on_overflow={on_overflow!r} must be 'raise' (a traced write past the capacity "
            "raises) or 'flag' (it sets the returned cache's overflow)"
        )
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
        on_overflow=on_overflow,
    )


def _past_end(capacity: int, held_B, need_B) -> str:
    """The line for a row of ``need_B`` (``held_B`` before the call) past ``capacity``."""
    b = int(np.argmax(need_B))
    need, held = int(need_B[b]), int(held_B[b])
    return (
        f"the cache holds {capacity} tokens per row but row {b} asks for {need} ({held} held "
        f"+ {need - held} new): pass a larger max_len to init_cache, or use a ring cache "
        "(init_cache(..., ring=True)) for a sliding-window model"
    )


def check_capacity(cache: KVCache, new_B=0) -> None:
    """Raises a ``DecodeError`` if a row of a linear cache would hold more than its
    ``capacity`` once ``new_B`` more tokens (an int, or ``[B]`` per row) are appended.

    Model calls check their tokens with it before the first write; ``check_capacity(cache)``
    after a jitted loop reports the rows whose writes went past the end (``overflow``).
    Nothing to check for a ring (it wraps by design). Traced values cannot raise here:
    inside ``attnlab.decode.checks.checked_jit`` they are a ``checkify`` check that raises
    this error after the call (``attnlab.errors.traced_check``); elsewhere the call's new
    cache goes through ``raise_on_overflow`` (``init_cache``'s ``on_overflow``).
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
        raise DecodeError(_past_end(cache.capacity, held_B, need_B))


def raise_on_overflow(cache: KVCache, held_B) -> KVCache:
    """``cache``, just written by a traced call (``held_B``: its ``lengths`` before), made
    to raise when the program runs if a row went past a linear cache's capacity.

    With ``on_overflow="raise"``: a ``lax.cond`` on ``any(lengths > capacity)`` whose taken
    branch alone calls the host (``jax.pure_callback``, which raises the ``DecodeError``
    there), its zero result added to ``lengths`` so the program keeps it. A pure callback
    has no effect to order, so the jitted call keeps JAX's fast dispatch path (on XLA:CPU
    it runs synchronously, as any program with a host callback does). Nothing is added
    for ``"flag"``, a ring, concrete lengths (the eager call has checked them), inside
    ``checked_jit`` (its ``checkify`` check reports it) or while a program is built for
    another platform (``attnlab.ops.paths.lowering_only``: a host callback cannot be
    lowered for it).
    """
    if (
        cache.on_overflow != "raise"
        or cache.ring
        or cache.slots is None
        or not isinstance(cache.lengths, jax.core.Tracer)
        or checking_traced()
        or paths.lowering_only()
    ):
        return cache
    capacity = cache.capacity

    def fail(held_B, need_B):
        need_B = np.asarray(need_B)  # a batched cond runs this branch for every row
        if (need_B > capacity).any():
            raise DecodeError(_past_end(capacity, np.asarray(held_B), need_B))
        return np.zeros((), np.int32)

    lengths_B = cache.lengths
    zero = jax.lax.cond(
        jnp.any(lengths_B > capacity),
        lambda: jax.pure_callback(
            fail,
            jax.ShapeDtypeStruct((), jnp.int32),
            jnp.asarray(held_B, jnp.int32),
            lengths_B,
            vmap_method="sequential",
        ),
        lambda: jnp.zeros((), jnp.int32),
    )
    return cache.replace(lengths=lengths_B + zero)


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
