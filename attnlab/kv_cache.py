"""The KV cache: an explicit pytree, passed in and returned, never hidden module state.

Layout: one entry per layer (the per-layer form of ``[L, B, K, S, H]``), keys and values
``[B, K, S, H]`` with only the K key/value heads stored, so GQA/MQA's saving is real. The
cache is head-major (S inside K): each head's keys are contiguous, so the attention dots
read the cache where it lies; an ``[B, S, K, H]`` cache would be transposed, whole, at
every decode step. ``write`` takes new keys/values in the model's ``[B, T, K, H]`` order.

``lengths[b]`` counts the tokens stored for row ``b``; the next token of row ``b`` is written
at index ``lengths[b]`` and sits at position ``lengths[b]``: rows of a ragged batch keep
their own lengths and positions. Encoder-decoder caches also hold the cross-attention keys
and values (same layout), computed once from the encoder output, and the source validity.

Memory: ``2 * L * B * S * K * H * bytes`` for self-attention (``kv_cache_bytes``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from attnlab.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple  # L x [B, K, S, H]
    v: tuple  # L x [B, K, S, H]
    lengths: jax.Array  # [B] int32
    cross_k: tuple | None = None  # L x [B, K, S_src, H]
    cross_v: tuple | None = None
    src_valid: jax.Array | None = None  # [B, S_src] bool

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]


def _dtype(cfg: ModelConfig, dtype):
    return jnp.dtype(cfg.dtype if dtype is None else dtype)


def _layers(cfg: ModelConfig) -> int:
    return cfg.decoder_layers if cfg.arch == "encoder_decoder" else cfg.n_layers


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for ``batch_size`` rows of up to ``max_len`` tokens."""
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
    shape = (batch_size, cfg.kv_heads, max_len, cfg.head_size)
    dt = _dtype(cfg, dtype)
    # One buffer per array (not one shared zeros): a jitted step may then donate the cache.
    return KVCache(
        k=tuple(jnp.zeros(shape, dt) for _ in range(_layers(cfg))),
        v=tuple(jnp.zeros(shape, dt) for _ in range(_layers(cfg))),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


def write(cache_BKSH, new_BTKH, start_B):
    """Writes ``new`` into each row ``b`` of the cache at index ``start_B[b]``."""
    new_BKTH = jnp.swapaxes(new_BTKH, 1, 2).astype(cache_BKSH.dtype)
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (0, s, 0)))(
        cache_BKSH, new_BKTH, start_B
    )


def truncate(cache: KVCache, size: int) -> KVCache:
    """The cache cut to its first ``size`` slots (a copy; cross-attention is left as is)."""
    cut = lambda x: x[:, :, :size]
    return cache.replace(k=tuple(map(cut, cache.k)), v=tuple(map(cut, cache.v)))


def paste(full: KVCache, part: KVCache) -> KVCache:
    """``part`` (from ``truncate``) written back over the first slots of ``full``."""
    put = lambda f, p: jax.lax.dynamic_update_slice(f, p, (0, 0, 0, 0))
    return part.replace(k=tuple(map(put, full.k, part.k)), v=tuple(map(put, full.v, part.v)))


def repeat_rows(cache: KVCache, n: int) -> KVCache:
    """Each row repeated ``n`` times in place (row ``b`` becomes rows ``b*n .. b*n+n-1``)."""
    return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), cache)


def take_rows(cache: KVCache, rows_B) -> KVCache:
    """The self-attention rows ``rows_B`` (beam reordering); cross-attention is left as is,
    so ``rows_B`` must map each row to a row of the same source."""
    take = lambda x: jnp.take(x, rows_B, axis=0)
    return cache.replace(
        k=tuple(map(take, cache.k)), v=tuple(map(take, cache.v)), lengths=take(cache.lengths)
    )


def kv_cache_bytes(cfg, batch_size: int, max_len: int, dtype="bfloat16") -> int:
    """Bytes of the self-attention cache: 2 * L * B * S * K * H * itemsize."""
    from attnlab.hf_config import as_model_config  # accepts HF config.json dicts too

    cfg = as_model_config(cfg)
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * _layers(cfg) * batch_size * max_len * cfg.kv_heads * cfg.head_size * itemsize
