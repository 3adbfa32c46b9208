"""The KV-cache pytree: shapes, memory formula, GQA saving, per-row writes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import KVCache, ModelConfig, init_cache, kv_cache_bytes
from attnlab import kv_cache as kvc

CFG = dict(vocab_size=50, d_model=64, n_layers=3, n_heads=8, max_len=128)


def test_init_cache_shapes_and_distinct_buffers():
    cfg = ModelConfig(**CFG, n_kv_heads=2)
    cache = init_cache(cfg, batch_size=3, max_len=100)
    assert isinstance(cache, KVCache)
    for x in (cache.k, cache.v):
        assert x.shape == (3, 3, 2, 100, 8) and x.dtype == jnp.float32  # [L, B, K, S, H]
        assert not np.asarray(x).any()
    assert cache.capacity == 100 and cache.batch_size == 3 and cache.n_layers == 3
    np.testing.assert_array_equal(cache.lengths, [0, 0, 0])
    assert cache.cross_k is None and cache.src_valid is None
    # Separate buffers, so a jitted step may donate the whole cache.
    assert cache.k.unsafe_buffer_pointer() != cache.v.unsafe_buffer_pointer()


def test_init_cache_dtype_and_encoder_decoder_layers():
    cfg = ModelConfig(**CFG, arch="encoder_decoder", n_decoder_layers=2, dtype="bfloat16")
    cache = init_cache(cfg, 1, 16)
    assert cache.n_layers == 2 and cache.k.dtype == jnp.bfloat16
    assert init_cache(cfg, 1, 16, dtype="float32").v.dtype == jnp.float32


def test_init_cache_errors():
    with pytest.raises(ValueError, match="exceeds ModelConfig.max_len=128"):
        init_cache(ModelConfig(**CFG), 1, 129)
    with pytest.raises(ValueError, match="nothing to cache"):
        init_cache(ModelConfig(**CFG, arch="encoder"), 1, 8)
    with pytest.raises(ValueError, match="max_len >= 1"):
        init_cache(ModelConfig(**CFG), 1, 0)


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float32", 4)])
def test_kv_cache_bytes_formula(dtype, itemsize):
    L, B, S, K, H = 3, 4, 100, 8, 8
    cfg = ModelConfig(**CFG)
    assert kv_cache_bytes(cfg, B, S, dtype) == 2 * L * B * S * K * H * itemsize
    cache = init_cache(cfg, B, S, dtype=dtype)
    assert cache.k.nbytes + cache.v.nbytes == kv_cache_bytes(cfg, B, S, dtype)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_gqa_cache_is_n_over_k_times_smaller(K):
    mha = kv_cache_bytes(ModelConfig(**CFG), 2, 64)
    gqa = kv_cache_bytes(ModelConfig(**CFG, n_kv_heads=K), 2, 64)
    assert mha == gqa * (8 // K)
    cache = init_cache(ModelConfig(**CFG, n_kv_heads=K), 2, 64)
    assert cache.k.shape[2] == K


@pytest.mark.parametrize("layer", [0, 2])
def test_write_at_each_rows_own_offset_in_one_layer(layer):
    cache_LBKSH = jnp.zeros((3, 2, 2, 6, 3))
    new_BTKH = jnp.arange(2 * 2 * 2 * 3, dtype=jnp.float32).reshape(2, 2, 2, 3) + 1
    write = jax.jit(kvc.write)  # the layer index traced, as inside a scan over layers
    out = np.asarray(write(cache_LBKSH, jnp.int32(layer), new_BTKH, jnp.array([0, 3])))
    np.testing.assert_array_equal(out[layer, 0, :, 0:2], np.swapaxes(new_BTKH[0], 0, 1))
    np.testing.assert_array_equal(out[layer, 1, :, 3:5], np.swapaxes(new_BTKH[1], 0, 1))
    rest = out.copy()
    rest[layer, 0, :, 0:2] = 0
    rest[layer, 1, :, 3:5] = 0
    assert not rest.any()  # nothing else written: no other layer, row or slot


def test_repeat_and_take_rows():
    cfg = ModelConfig(**CFG)
    cache = init_cache(cfg, 2, 4)
    cache = cache.replace(
        k=cache.k + jnp.arange(2.0).reshape(1, 2, 1, 1, 1),
        lengths=jnp.array([1, 2], jnp.int32),
    )
    wide = kvc.repeat_rows(cache, 3)
    assert wide.batch_size == 6
    np.testing.assert_array_equal(wide.lengths, [1, 1, 1, 2, 2, 2])
    picked = kvc.take_rows(wide, jnp.array([2, 2, 0, 5, 3, 3]))
    np.testing.assert_array_equal(np.asarray(picked.k)[:, :, 0, 0, 0], [[0, 0, 0, 1, 1, 1]] * 3)
    np.testing.assert_array_equal(picked.lengths, [1, 1, 1, 2, 2, 2])
    assert jax.tree.structure(picked) == jax.tree.structure(wide)
