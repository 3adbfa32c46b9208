"""``attnlab.ops.positions`` against the float64 formulas in ``tests/reference.py``."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from attnlab.ops import (
    alibi_bias,
    alibi_slopes,
    apply_rope,
    relative_position_bias,
    relative_position_bucket,
    rope_inv_frequencies,
    sinusoidal,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}

# --------------------------------------------------------------------------------------------
# Sinusoidal
# --------------------------------------------------------------------------------------------


def test_sinusoidal_values_from_the_formula():
    table = np.asarray(sinusoidal(4, 512), np.float64)
    assert table.shape == (4, 512)
    np.testing.assert_allclose(table[1, 0], math.sin(1.0), rtol=1e-6)
    np.testing.assert_allclose(table[1, 1], math.cos(1.0), rtol=1e-6)
    np.testing.assert_allclose(table[2, 2], math.sin(2.0 / 10000 ** (2 / 512)), rtol=1e-6)
    np.testing.assert_allclose(table[2, 3], math.cos(2.0 / 10000 ** (2 / 512)), rtol=1e-6)
    # Position 0: every sine is 0 and every cosine is 1.
    np.testing.assert_array_equal(table[0, 0::2], 0.0)
    np.testing.assert_array_equal(table[0, 1::2], 1.0)


@pytest.mark.parametrize("layout", ["interleaved", "split"])
@pytest.mark.parametrize(("num_positions", "d"), [(64, 512), (17, 6)])
def test_sinusoidal_table(num_positions, d, layout):
    got = sinusoidal(num_positions, d, layout=layout)
    assert got.shape == (num_positions, d) and got.dtype == jnp.float32
    want = ref.sinusoidal(num_positions, d, layout=layout)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)


def test_sinusoidal_split_is_a_permutation_of_interleaved():
    d = 8
    inter = np.asarray(sinusoidal(10, d))
    split = np.asarray(sinusoidal(10, d, layout="split"))
    np.testing.assert_array_equal(split[:, : d // 2], inter[:, 0::2])
    np.testing.assert_array_equal(split[:, d // 2 :], inter[:, 1::2])


def test_sinusoidal_base_and_dtype():
    got = sinusoidal(9, 6, base=100.0, dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    want = ref.sinusoidal(9, 6, base=100.0)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, atol=1e-2)


def test_sinusoidal_rejects_odd_width_and_unknown_layout():
    with pytest.raises(ValueError, match="even width, got d=7"):
        sinusoidal(4, 7)
    with pytest.raises(ValueError, match="layout='cat'"):
        sinusoidal(4, 8, layout="cat")


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------

B, T, N, H = 2, 6, 3, 8


def _x(seed, shape=(B, T, N, H), dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _positions(T=T, start=0):
    return jnp.asarray(np.tile(np.arange(start, start + T), (B, 1)), jnp.int32)


def test_rope_inv_frequencies():
    np.testing.assert_allclose(
        np.asarray(rope_inv_frequencies(H)), ref.rope_inv_frequencies(H), rtol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(rope_inv_frequencies(16, theta=500.0)),
        ref.rope_inv_frequencies(16, theta=500.0),
        rtol=1e-6,
    )


@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_apply_rope_matches_reference(theta):
    x = _x(0)
    rng = np.random.default_rng(1)
    positions_BT = jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32)
    got = apply_rope(x, positions_BT, theta=theta)
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), ref.apply_rope(x, positions_BT, theta=theta), **TOL)


def test_apply_rope_position_zero_is_identity():
    x = _x(2)
    np.testing.assert_array_equal(
        np.asarray(apply_rope(x, jnp.zeros((B, T), jnp.int32))), np.asarray(x)
    )


def test_apply_rope_preserves_norms():
    x = _x(3)
    got = apply_rope(x, _positions(start=5))
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(got), axis=-1), np.linalg.norm(np.asarray(x), axis=-1), **TOL
    )
    # Each pair (i, i + H/2) is rotated on its own, so its norm is preserved too.
    half = H // 2
    pair_norm = lambda a: np.hypot(np.asarray(a)[..., :half], np.asarray(a)[..., half:])  # noqa: E731
    np.testing.assert_allclose(pair_norm(got), pair_norm(x), **TOL)


def test_apply_rope_dot_products_depend_only_on_offset():
    """<rope(q, m), rope(k, n)> is a function of m - n: shifting both by c changes nothing."""
    q_BTNH, k_BTNH = _x(4), _x(5)
    rng = np.random.default_rng(6)
    m_BT, n_BT = rng.integers(0, 50, (B, T)), rng.integers(0, 50, (B, T))

    def scores_BTN(m_BT, n_BT):
        q = apply_rope(q_BTNH, jnp.asarray(m_BT, jnp.int32))
        k = apply_rope(k_BTNH, jnp.asarray(n_BT, jnp.int32))
        return np.einsum("BTNH,BTNH->BTN", np.asarray(q, np.float64), np.asarray(k, np.float64))

    base_BTN = scores_BTN(m_BT, n_BT)
    for c in (1, 7, 40):
        np.testing.assert_allclose(scores_BTN(m_BT + c, n_BT + c), base_BTN, rtol=1e-4, atol=1e-4)
    # ... while the offset itself matters.
    assert not np.allclose(scores_BTN(m_BT + 3, n_BT), base_BTN, atol=1e-2)


def test_apply_rope_bfloat16_keeps_dtype():
    x = _x(6, dtype=jnp.bfloat16)
    got = apply_rope(x, _positions())
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got.astype(jnp.float32)),
        ref.apply_rope(x.astype(jnp.float32), _positions()),
        atol=3e-2,
        rtol=3e-2,
    )


def test_apply_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head_dim, got 7"):
        apply_rope(_x(7, (B, T, N, 7)), _positions())
    with pytest.raises(ValueError, match="even head_dim"):
        rope_inv_frequencies(5)


# --------------------------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------------------------


def test_alibi_slopes_eight_heads():
    np.testing.assert_allclose(
        np.asarray(alibi_slopes(8)), [2.0**-i for i in range(1, 9)], rtol=1e-7
    )


@pytest.mark.parametrize("num_heads", [1, 2, 4, 16, 32])
def test_alibi_slopes_powers_of_two(num_heads):
    got = np.asarray(alibi_slopes(num_heads))
    want = [2.0 ** (-8.0 * h / num_heads) for h in range(1, num_heads + 1)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got, ref.alibi_slopes(num_heads), rtol=1e-6)


@pytest.mark.parametrize("num_heads", [3, 5, 6, 7, 12, 20])
def test_alibi_slopes_interpolated(num_heads):
    got = np.asarray(alibi_slopes(num_heads))
    assert got.shape == (num_heads,)
    np.testing.assert_allclose(got, ref.alibi_slopes(num_heads), rtol=1e-6)


def test_alibi_slopes_twelve_heads_by_hand():
    # 8 slopes 2^-1 .. 2^-8, then the odd-indexed slopes 2^-0.5, 2^-1.5, ... of 16 heads.
    want = [2.0**-i for i in range(1, 9)] + [2.0 ** -(i + 0.5) for i in range(4)]
    np.testing.assert_allclose(np.asarray(alibi_slopes(12)), want, rtol=1e-6)


def test_alibi_bias_matches_reference():
    slopes_N = alibi_slopes(4)
    rng = np.random.default_rng(8)
    q_BT = rng.integers(0, 20, (2, 3))
    k_BS = rng.integers(0, 20, (2, 5))
    got = alibi_bias(slopes_N, jnp.asarray(q_BT), jnp.asarray(k_BS))
    assert got.shape == (2, 4, 3, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref.alibi_bias(slopes_N, q_BT, k_BS), **TOL)
    # The diagonal of a self-attention bias is zero.
    pos_BT = jnp.asarray(np.tile(np.arange(6), (2, 1)))
    diag = np.diagonal(np.asarray(alibi_bias(slopes_N, pos_BT, pos_BT)), axis1=-2, axis2=-1)
    np.testing.assert_array_equal(diag, 0.0)


# --------------------------------------------------------------------------------------------
# T5 relative position buckets
# --------------------------------------------------------------------------------------------

# Sorted offsets k_pos - q_pos, well past every max_distance used below (one shape for all).
REL = np.concatenate([[-10_000, -1000], np.arange(-300, 301), [1000, 10_000]])


def _bucket(**kwargs):
    """{offset: bucket} over REL."""
    got = np.asarray(relative_position_bucket(jnp.asarray(REL), **kwargs))
    return dict(zip(REL.tolist(), got.tolist(), strict=True))


@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 64), (8, 20), (64, 256)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bucket_matches_reference(bidirectional, num_buckets, max_distance):
    got = relative_position_bucket(
        jnp.asarray(REL),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    )
    want = ref.relative_position_bucket(
        REL, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.asarray(got).min() >= 0 and np.asarray(got).max() < num_buckets


def test_relative_position_bucket_by_hand():
    # Bidirectional, 32 buckets: 16 for keys at or before the query, 16 for keys after it;
    # distances below 8 are exact, larger ones log-spaced up to 128, then clipped.
    got = _bucket()
    rel = [0, -1, -7, 1, 7, -8, 8, -1000, 1000]
    assert [got[r] for r in rel] == [0, 1, 7, 17, 23, 8, 24, 15, 31]
    # Unidirectional: keys after the query share bucket 0; 16 exact buckets, clipped at 31.
    got = _bucket(bidirectional=False)
    rel = [5, 1, 0, -1, -15, -16, -10_000]
    assert [got[r] for r in rel] == [0, 0, 0, 1, 15, 16, 31]


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bucket_is_monotone_in_distance(bidirectional):
    got = np.asarray(relative_position_bucket(jnp.asarray(REL), bidirectional=bidirectional))
    assert np.all(np.diff(got[REL <= 0]) <= 0)  # keys further before the query
    assert np.all(np.diff(got[REL > 0]) >= 0)  # keys further after it


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bias_gathers(bidirectional):
    num_buckets, heads, max_distance = 16, 3, 40
    rng = np.random.default_rng(9)
    table_XN = rng.standard_normal((num_buckets, heads)).astype(np.float32)
    q_BT = rng.integers(0, 60, (2, 4))
    k_BS = rng.integers(0, 60, (2, 5))
    got = jax.jit(relative_position_bias, static_argnames=("bidirectional", "max_distance"))(
        jnp.asarray(table_XN),
        jnp.asarray(q_BT),
        jnp.asarray(k_BS),
        bidirectional=bidirectional,
        max_distance=max_distance,
    )
    assert got.shape == (2, heads, 4, 5)
    want = np.zeros((2, heads, 4, 5), np.float32)
    for b in range(2):
        for t in range(4):
            for s in range(5):
                bucket = ref.relative_position_bucket_scalar(
                    k_BS[b, s] - q_BT[b, t],
                    bidirectional=bidirectional,
                    num_buckets=num_buckets,
                    max_distance=max_distance,
                )
                want[b, :, t, s] = table_XN[bucket]
    np.testing.assert_array_equal(np.asarray(got), want)
