"""A cache cut and pasted along its tokens (``truncate``, ``paste``: the prefix a phased
loop shares) or its rows (``repeat_rows``, ``take_rows``); a ring refuses the cuts along its
tokens (``attnlab.kv_cache``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.kv_cache.cache import KVCache, _map_layers
from attnlab.kv_cache.slots import layer_arrays


def _refuse_ring(cache: KVCache, what: str):
    if cache.ring:
        raise ValueError(
            f"{what} cuts a linear cache by slots, but this cache is a ring buffer "
            f"(KVCache.window={cache.window}) whose slots are not positions: run the loop "
            "without phases, or build the cache with init_cache(..., ring=False)"
        )


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
