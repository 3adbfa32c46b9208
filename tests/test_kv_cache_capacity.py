"""A cache refuses writes past its capacity (eager) or flags them (jit, ``on_overflow="flag"``);
absolute position tables refuse positions past their end instead of returning NaN logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import cases

from attnlab import ModelConfig, init_cache
from attnlab.errors import DecodeError
from attnlab.kv_cache import check_capacity
from attnlab.nn.models import build_model

TINY = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=16)
IDS_B12 = (np.arange(24).reshape(2, 12) * 5) % 32


@pytest.fixture(scope="module")
def rope_lm():
    return build_model(ModelConfig(**TINY), seed=0)


@pytest.fixture(scope="module")
def step(rope_lm):
    """A jitted call that returns the cache (nothing raises inside it)."""
    return jax.jit(lambda ids_BT, cache: rope_lm(ids_BT, cache=cache).cache)


def test_an_eager_call_past_the_cache_capacity_raises(rope_lm, step):
    cache = step(jnp.asarray(IDS_B12[:, :8]), init_cache(rope_lm.cfg, 2, 8))  # full
    with pytest.raises(DecodeError, match=r"holds 8 tokens per row .* asks for 9 .*larger max_len"):
        rope_lm(jnp.asarray(IDS_B12[:, 8:9]), cache=cache)
    np.testing.assert_array_equal(cache.lengths, [8, 8])


def test_a_prefill_past_the_capacity_is_refused_but_padding_does_not_count(rope_lm):
    cache = init_cache(rope_lm.cfg, 2, 8)
    with pytest.raises(DecodeError, match=r"row 0 asks for 12 \(0 held \+ 12 new\)"):
        rope_lm(jnp.asarray(IDS_B12), cache=cache)
    valid_BT = np.arange(12)[None, :] < np.array([[8], [5]])  # right-padded rows that fit
    out = rope_lm(jnp.asarray(IDS_B12), cache=cache, valid_BT=jnp.asarray(valid_BT))
    np.testing.assert_array_equal(out.cache.lengths, [8, 5])
    assert not np.asarray(out.cache.overflow).any()


def test_under_jit_the_returned_cache_flags_the_rows_that_overflowed(rope_lm, step):
    # on_overflow="raise" (the default) would raise instead (tests/test_cache_overflow.py)
    cache = step(jnp.asarray(IDS_B12[:, :8]), init_cache(rope_lm.cfg, 2, 8, on_overflow="flag"))
    assert not np.asarray(cache.overflow).any()  # exactly full is not an overflow
    check_capacity(cache)
    for t in range(8, 12):
        cache = step(jnp.asarray(IDS_B12[:, t : t + 1]), cache)
    np.testing.assert_array_equal(cache.lengths, [12, 12])
    np.testing.assert_array_equal(cache.overflow, [True, True])
    with pytest.raises(DecodeError, match=r"holds 8 tokens per row .* asks for 12"):
        check_capacity(cache)


def test_a_ring_cache_wraps_past_its_window_without_a_flag():
    cache = init_cache(ModelConfig(**TINY, sliding_window=4), 2, 16, ring=True)
    assert cache.slots == 4 and cache.capacity == 16
    cache = cache.replace(lengths=jnp.asarray([12, 15], jnp.int32))  # wrapped three times
    assert not np.asarray(cache.overflow).any()
    check_capacity(cache, 1)  # slots are reused by design: a ring never overflows


@pytest.mark.parametrize(
    "position", cases(["learned", "sinusoidal"], slow={"sinusoidal": "the same check as learned"})
)
def test_absolute_positions_past_max_len_raise_in_eager_calls(position):
    lm = build_model(ModelConfig(**{**TINY, "max_len": 8}, position=position), seed=0)
    asked = rf"position 8 \(row 0, token 8\) .*max_len=8 .*{position}"
    with pytest.raises(DecodeError, match=asked):
        lm(jnp.asarray(IDS_B12))
    with pytest.raises(DecodeError, match=r"position 8 \(row 1, token 1\)"):
        lm(jnp.asarray(IDS_B12[:, :2]), positions_BT=jnp.asarray([[0, 1], [7, 8]]))
