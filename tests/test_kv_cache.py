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
    assert cache.cross is None and cache.src_valid is None
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
        layers={**cache.layers, "keys": cache.k + jnp.arange(2.0).reshape(1, 2, 1, 1, 1)},
        lengths=jnp.array([1, 2], jnp.int32),
    )
    wide = kvc.repeat_rows(cache, 3)
    assert wide.batch_size == 6
    np.testing.assert_array_equal(wide.lengths, [1, 1, 1, 2, 2, 2])
    picked = kvc.take_rows(wide, jnp.array([2, 2, 0, 5, 3, 3]))
    np.testing.assert_array_equal(np.asarray(picked.k)[:, :, 0, 0, 0], [[0, 0, 0, 1, 1, 1]] * 3)
    np.testing.assert_array_equal(picked.lengths, [1, 1, 1, 2, 2, 2])
    assert jax.tree.structure(picked) == jax.tree.structure(wide)


def test_split_layers_round_trip_and_rows():
    cfg = ModelConfig(**CFG)
    cache = init_cache(cfg, 2, 4)
    keys = jax.random.normal(jax.random.key(0), cache.k.shape)
    cache = cache.replace(layers={**cache.layers, "keys": keys}, lengths=jnp.array([1, 3]))
    plus_one = cache.replace(layers={**cache.layers, "keys": cache.k + 1})
    split = kvc.split_layers(cache)
    assert (
        split.split and len(split.k) == cfg.n_layers and split.k[1].shape == (1, *cache.k.shape[1:])
    )
    assert (split.n_layers, split.batch_size, split.slots) == (cache.n_layers, 2, 4)
    np.testing.assert_array_equal(split.k[1][0], cache.k[1])
    back = kvc.join_layers(split)
    np.testing.assert_array_equal(back.k, cache.k)
    np.testing.assert_array_equal(back.v, cache.v)
    rows = jnp.array([1, 1, 0])
    np.testing.assert_array_equal(
        kvc.join_layers(kvc.take_rows(split, rows)).k, kvc.take_rows(cache, rows).k
    )
    wide = kvc.join_layers(kvc.repeat_rows(split, 2))
    np.testing.assert_array_equal(wide.k, kvc.repeat_rows(cache, 2).k)
    cut = kvc.truncate(split, 2)
    np.testing.assert_array_equal(kvc.join_layers(cut).k, kvc.truncate(cache, 2).k)
    pasted = kvc.paste(split, kvc.truncate(kvc.split_layers(plus_one), 2))
    np.testing.assert_array_equal(
        kvc.join_layers(pasted).k, kvc.paste(cache, kvc.truncate(plus_one, 2)).k
    )


def test_a_split_cache_steps_like_the_stacked_one():
    """Separate blocks over a split cache write the same keys/values and give the same
    logits as the scanned stack over the stacked cache."""
    from attnlab import build_model

    cfg = ModelConfig(**CFG)
    model = build_model(cfg, seed=0)
    cache = init_cache(cfg, 2, 8)
    tokens = jnp.array([[3, 4, 5], [6, 7, 8]])
    want = model(tokens, cache=cache)
    model.decoder.unstack()
    got = model(tokens, cache=kvc.split_layers(cache))
    assert got.cache.split
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(kvc.join_layers(got.cache).k, want.cache.k, atol=1e-6)
    np.testing.assert_allclose(kvc.join_layers(got.cache).v, want.cache.v, atol=1e-6)
    np.testing.assert_array_equal(got.cache.lengths, [3, 3])


def test_the_sampling_loop_copies_no_layer_out_of_the_cache():
    """Over separate blocks the loop holds one cache array per layer: the compiled loop has
    no dynamic slice that cuts a layer [B, K, S, H] out of a stacked [L, B, K, S, H]."""
    import re

    from attnlab import build_model
    from attnlab.decode.compiled import Decoder
    from attnlab.decode.sampling import SamplingConfig

    cfg = ModelConfig(**CFG)
    assert cfg.decode_unstacked
    dec, params = Decoder.for_model(build_model(cfg, seed=0))
    B, S = 2, 16
    cache = init_cache(cfg, B, S)
    args = (jnp.zeros((B, cfg.vocab_size)), jax.random.key(0), 4, -1, 0, SamplingConfig().traced())
    hlo = dec.sample_loop.lower(params, cache, *args, return_logits=False).compile().as_text()
    K, H = cfg.n_kv_heads, cfg.head_dim
    layer_shape = rf"f32\[{B},{K},{S},{H}\]"
    cuts = [
        line for line in hlo.splitlines()
        if re.search(rf"= {layer_shape}\S* (dynamic-slice|fusion)\(", line) and "dynamic" in line
    ]  # fmt: skip
    assert not cuts, cuts[:2]


@pytest.mark.parametrize("B", [1, 3])
def test_a_decoding_step_copies_no_layers_cache(B):
    """Each step writes its keys/values into the cache in place and the attention dots read
    the cache where it lies: the compiled loop holds no copy, transposed or not, of a
    layer's keys or values (at one row, formerly two per layer and step)."""
    import math
    import re

    from attnlab import build_model
    from attnlab.decode.compiled import Decoder
    from attnlab.decode.sampling import SamplingConfig

    cfg = ModelConfig(**CFG)
    dec, params = Decoder.for_model(build_model(cfg, seed=0))
    S = 16
    cache = init_cache(cfg, B, S)
    args = (jnp.zeros((B, cfg.vocab_size)), jax.random.key(0), 4, -1, 0, SamplingConfig().traced())
    hlo = dec.sample_loop.lower(params, cache, *args, return_logits=False).compile().as_text()
    size = B * cfg.n_kv_heads * S * cfg.head_dim
    copies = [
        line.strip()[:120]
        for line in hlo.splitlines()
        if (m := re.search(r"%(?:copy|transpose)\S* = f32\[([\d,]+)\]", line))
        and math.prod(int(d) for d in m.group(1).split(",")) == size
    ]
    assert not copies, copies[:4]


# ------------------------------------------------------------------------------------------
# Ring buffers: W slots, position p in slot p % W
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window_layers, max_len, ring, slots",
    [
        (None, 100, None, 16),  # every layer slides and max_len > W: a ring by default
        (None, 16, None, 16),  # max_len <= W: linear (no saving)
        (None, 10, True, 16),  # asked for: W slots
        (None, 100, False, 100),
        ((0, 1, 2), 100, None, 16),  # every layer listed
        ((0, 2), 100, None, 100),  # a global layer needs every key: linear
    ],
)
def test_ring_cache_has_window_slots_and_bytes_agree(window_layers, max_len, ring, slots):
    cfg = ModelConfig(**CFG, n_kv_heads=2, sliding_window=16, sliding_window_layers=window_layers)
    cache = init_cache(cfg, 2, max_len, ring=ring)
    assert cache.k.shape == cache.v.shape == (3, 2, 2, slots, 8)  # [L, B, K, W, H]
    assert cache.slots == slots and cache.capacity == max_len
    assert cache.ring == (cache.window is not None) and cache.window in (None, slots)
    nbytes = kv_cache_bytes(cfg, 2, max_len, "float32", ring=ring)
    assert cache.k.nbytes + cache.v.nbytes == nbytes
    assert nbytes == 2 * 3 * 2 * slots * 2 * 8 * 4
    # Static: the layout is part of the tree structure, not a leaf.
    assert len(jax.tree.leaves(cache)) == 3


def test_ring_positions_follow_the_rows_lengths():
    """Slot s holds the latest position p < length with p % W == s; negative: empty."""
    got = np.asarray(kvc.ring_positions(jnp.array([0, 3, 4, 11]), 4))
    np.testing.assert_array_equal(
        got, [[-4, -3, -2, -1], [0, 1, 2, -1], [0, 1, 2, 3], [8, 9, 10, 7]]
    )


def test_ring_write_keeps_each_rows_last_real_tokens():
    """A call of T = 7 tokens over a 4-slot ring: row 0 starts at 2 with 7 real tokens
    (positions 2..8, the last four kept), row 1 at 0 with 2 real ones (the padding after
    them must not overwrite anything)."""
    start_B, count_B = jnp.array([2, 0]), jnp.array([7, 2])
    slots_BT = np.asarray(kvc.ring_slots(start_B, count_B, 7, 4))
    np.testing.assert_array_equal(slots_BT, [[4, 4, 4, 1, 2, 3, 0], [0, 1, 4, 4, 4, 4, 4]])
    new_BTKH = (jnp.arange(7.0)[None, :, None, None] + 1) * jnp.array([1.0, 10.0])[
        :, None, None, None
    ]
    out = np.asarray(kvc.scatter(jnp.zeros((1, 2, 1, 4, 1)), 0, new_BTKH, slots_BT))
    np.testing.assert_array_equal(out[0, :, 0, :, 0], [[7, 4, 5, 6], [10, 20, 0, 0]])
    np.testing.assert_array_equal(
        kvc.ring_positions(start_B + count_B, 4), [[8, 5, 6, 7], [0, 1, -2, -1]]
    )


def test_rows_of_a_ring_keep_its_layout():
    cfg = ModelConfig(**CFG, sliding_window=4)
    cache = init_cache(cfg, 2, 32)
    for moved in (kvc.repeat_rows(cache, 3), kvc.take_rows(cache, jnp.array([1, 0]))):
        assert moved.window == 4 and moved.capacity == 32 and moved.slots == 4
