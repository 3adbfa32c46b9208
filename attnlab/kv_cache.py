"""The KV cache: an explicit pytree, passed in and returned, never hidden module state.

Layout: one entry per layer (the per-layer form of ``[L, B, S, K, H]``), keys and values
``[B, S, K, H]`` with only the K key/value heads stored, so GQA/MQA's saving is real.
``lengths[b]`` counts the tokens stored for row ``b``; the next token of row ``b`` is written
at index ``lengths[b]`` and sits at position ``lengths[b]``: rows of a ragged batch keep
their own lengths and positions. Encoder-decoder caches also hold the cross-attention keys
and values, computed once from the encoder output, and the source validity.

Memory: ``2 * L * B * S * K * H * bytes`` for self-attention (``kv_cache_bytes``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from attnlab.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple  # L x [B, S, K, H]
    v: tuple  # L x [B, S, K, H]
    lengths: jax.Array  # [B] int32
    cross_k: tuple | None = None  # L x [B, S_src, K, H]
    cross_v: tuple | None = None
    src_valid: jax.Array | None = None  # [B, S_src] bool

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]


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
    layers = cfg.decoder_layers if cfg.arch == "encoder_decoder" else cfg.n_layers
    shape = (batch_size, max_len, cfg.kv_heads, cfg.head_size)
    zeros = jnp.zeros(shape, _dtype(cfg, dtype))
    return KVCache(
        k=tuple(zeros for _ in range(layers)),
        v=tuple(zeros for _ in range(layers)),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


def write(cache_BSKH, new_BTKH, start_B):
    """Writes ``new`` into each row ``b`` of the cache at index ``start_B[b]``."""
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (s, 0, 0)))(
        cache_BSKH, new_BTKH.astype(cache_BSKH.dtype), start_B
    )


def kv_cache_bytes(cfg, batch_size: int, max_len: int, dtype="bfloat16") -> int:
    """Bytes of the self-attention cache: 2 * L * B * S * K * H * itemsize."""
    from attnlab.hf_config import as_model_config  # accepts HF config.json dicts too

    cfg = as_model_config(cfg)
    layers = cfg.decoder_layers if cfg.arch == "encoder_decoder" else cfg.n_layers
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * layers * batch_size * max_len * cfg.kv_heads * cfg.head_size * itemsize
