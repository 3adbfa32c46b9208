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

A write past a linear cache's capacity (a row asking for more than ``S`` tokens) is
never silent: an eager call raises a ``DecodeError`` before writing. Under ``jit`` the
writes past the end are dropped, and the cache's static ``on_overflow`` (``init_cache``)
chooses what else happens: ``"raise"`` (the default) makes the program call back to the
host, only then, and raise the same line (``raise_on_overflow``); ``"flag"`` adds nothing
and leaves the returned cache's ``overflow`` set (for programs lowered for another platform
or exported, and loops that check the capacity on the host, as ``generate`` does).
``attnlab.decode.checks.checked_jit`` raises it with ``checkify`` whatever the choice.

Memory: the sum over entries of ``L * B * prod(shape) * itemsize`` (``kv_cache_bytes``),
``2 * L * B * S * K * H * itemsize`` for the built-in attention, with ``S = W`` for a ring.
"""

from __future__ import annotations

from attnlab.kv_cache.cache import (
    KVCache,
    cache_entries,
    cache_layout,
    check_capacity,
    init_cache,
    join_layers,
    kv_cache_bytes,
    raise_on_overflow,
    split_layers,
)
from attnlab.kv_cache.ring import (  # noqa: F401 - the ring's names, where callers look for them
    Ring,
    ring_positions,
    ring_size,
    ring_slots,
    ring_window,
)
from attnlab.kv_cache.rows import paste, repeat_rows, take_rows, truncate
from attnlab.kv_cache.slots import LayerCache, layer, layer_arrays, scatter, write

__all__ = [
    "cache_entries",
    "cache_layout",
    "check_capacity",
    "init_cache",
    "join_layers",
    "kv_cache_bytes",
    "KVCache",
    "layer",
    "layer_arrays",
    "LayerCache",
    "paste",
    "raise_on_overflow",
    "repeat_rows",
    "Ring",
    "ring_positions",
    "ring_size",
    "ring_slots",
    "ring_window",
    "scatter",
    "split_layers",
    "take_rows",
    "truncate",
    "write",
]
