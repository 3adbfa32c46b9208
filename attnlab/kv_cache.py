"""The KV cache: an explicit pytree, passed in and returned, never hidden module state.

Layout: keys and values are stacked arrays ``[L, B, K, S, H]`` with a leading layer axis
(the stack's layers scan over it) and only the K key/value heads stored, so GQA/MQA's
saving is real. Each layer's slice is head-major (S inside K): each head's keys are
contiguous, so the attention dots read the cache where it lies; an ``[B, S, K, H]`` cache
would be transposed, whole, at every decode step. ``write`` takes new keys/values in the
model's ``[B, T, K, H]`` order and writes them into one layer, in place.

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
    k: jax.Array  # [L, B, K, S, H]
    v: jax.Array  # [L, B, K, S, H]
    lengths: jax.Array  # [B] int32
    cross_k: jax.Array | None = None  # [L, B, K, S_src, H]
    cross_v: jax.Array | None = None
    src_valid: jax.Array | None = None  # [B, S_src] bool

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]


def _dtype(cfg: ModelConfig, dtype):
    return jnp.dtype(cfg.dtype if dtype is None else dtype)


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
    shape = (cfg.stack_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
    dt = _dtype(cfg, dtype)
    # Two buffers (not one shared zeros): a jitted step may then donate the cache.
    return KVCache(
        k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), lengths=jnp.zeros((batch_size,), jnp.int32)
    )


def write(cache_LBKSH, layer, new_BTKH, start_B):
    """Writes ``new`` into layer ``layer`` of the cache, row ``b`` at index ``start_B[b]``.

    ``layer`` may be traced (inside a scan over layers). One scatter in the cache's own
    layout, in place inside a loop; slots past the capacity are dropped.
    """
    B, T = new_BTKH.shape[:2]
    rows_B1 = jnp.arange(B)[:, None]
    slots_BT = start_B[:, None] + jnp.arange(T)[None, :]
    # Advanced indices (layer, rows, slots) broadcast to [B, T] and lead: [B, T, K, H].
    return cache_LBKSH.at[layer, rows_B1, :, slots_BT, :].set(
        new_BTKH.astype(cache_LBKSH.dtype), mode="drop"
    )


def layer(cache_LBKSH, index):
    """Layer ``index`` (may be traced) of a stacked cache array: ``[B, K, S, H]``."""
    return jax.lax.dynamic_index_in_dim(cache_LBKSH, index, 0, keepdims=False)


def truncate(cache: KVCache, size: int) -> KVCache:
    """The cache cut to its first ``size`` slots (a copy; cross-attention is left as is)."""
    return cache.replace(k=cache.k[:, :, :, :size], v=cache.v[:, :, :, :size])


def paste(full: KVCache, part: KVCache) -> KVCache:
    """``part`` (from ``truncate``) written back over the first slots of ``full``."""
    put = lambda f, p: jax.lax.dynamic_update_slice(f, p, (0,) * f.ndim)
    return part.replace(k=put(full.k, part.k), v=put(full.v, part.v))


def repeat_rows(cache: KVCache, n: int) -> KVCache:
    """Each row repeated ``n`` times in place (row ``b`` becomes rows ``b*n .. b*n+n-1``)."""
    per_layer = lambda x: None if x is None else jnp.repeat(x, n, axis=1)
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
    so ``rows_B`` must map each row to a row of the same source."""
    return cache.replace(
        k=jnp.take(cache.k, rows_B, axis=1),
        v=jnp.take(cache.v, rows_B, axis=1),
        lengths=jnp.take(cache.lengths, rows_B, axis=0),
    )


def kv_cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype="bfloat16") -> int:
    """Bytes of the self-attention cache: 2 * L * B * S * K * H * itemsize."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"kv_cache_bytes takes a ModelConfig, got {type(cfg).__name__}; convert a Hugging "
            "Face config with attnlab.pretrained.model_config_from_hf"
        )
    itemsize = jnp.dtype(dtype).itemsize
    L, K, H = cfg.stack_layers, cfg.n_kv_heads, cfg.head_dim
    return 2 * L * batch_size * max_len * K * H * itemsize


@struct.dataclass
class LayerView:
    """One layer of a stacked cache inside the scan over layers.

    ``append`` writes a call's keys/values into layer ``index`` at each row's ``start_B``
    (in place in the stacked arrays) and returns the layer's keys/values ``[B, S, K, H]``
    for attention: the swap of S and K is folded into the attention dots by XLA.
    """

    k: jax.Array  # [L, B, K, S, H]
    v: jax.Array
    index: jax.Array  # int32 scalar (traced under scan)
    start_B: jax.Array

    def append(self, k_BTKH, v_BTKH):
        k = write(self.k, self.index, k_BTKH, self.start_B)
        v = write(self.v, self.index, v_BTKH, self.start_B)
        k_BSKH, v_BSKH = (jnp.swapaxes(layer(x, self.index), 1, 2) for x in (k, v))
        return self.replace(k=k, v=v), k_BSKH, v_BSKH
