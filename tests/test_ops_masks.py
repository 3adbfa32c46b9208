"""``attnlab.ops.masks`` against brute-force NumPy loops over (batch, query, key).

A few fixed sizes are reused throughout: on CPU each new shape costs a compilation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.ops import masks
from attnlab.ops.masks import MaskSpec

B, N, T, S = 3, 4, 4, 6


def _loop(B, T, S, allowed):
    """[B, 1, T, S] mask with ``allowed(b, t, s)`` at each entry."""
    out = np.zeros((B, 1, T, S), bool)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                out[b, 0, t, s] = allowed(b, t, s)
    return out


def _check(mask, want):
    """``mask`` is boolean, has ``want``'s shape, broadcasts to [B, N, T, S], equals ``want``."""
    mask = np.asarray(mask)
    assert mask.dtype == bool
    assert mask.shape == want.shape, (mask.shape, want.shape)
    full = (B, N) + mask.shape[2:]
    assert np.broadcast_shapes(mask.shape, full) == full
    np.testing.assert_array_equal(mask, want)


# --------------------------------------------------------------------------------------------
# Causal, sliding window, prefix-LM
# --------------------------------------------------------------------------------------------


def test_causal():
    _check(masks.causal(S), _loop(1, S, S, lambda b, t, s: s <= t))
    _check(masks.causal(S, S), _loop(1, S, S, lambda b, t, s: s <= t))
    _check(masks.causal(T, S), _loop(1, T, S, lambda b, t, s: s <= t))
    _check(masks.causal(1, S), _loop(1, 1, S, lambda b, t, s: s <= t))


def test_causal_scalar_offset_is_a_row_of_the_full_mask():
    full = np.asarray(masks.causal(S, S))
    for p in range(S):
        np.testing.assert_array_equal(
            np.asarray(masks.causal(1, S, offset=p)), full[:, :, p : p + 1]
        )
    # A block of T queries starting at p is the matching block of rows.
    np.testing.assert_array_equal(np.asarray(masks.causal(T, S, offset=2)), full[:, :, 2 : 2 + T])
    _check(masks.causal(T, S, offset=2), _loop(1, T, S, lambda b, t, s: s <= 2 + t))


def test_causal_per_row_offsets():
    offsets_B = np.array([0, 3, 5])
    full = np.asarray(masks.causal(S, S))
    got = masks.causal(1, S, offset=offsets_B)
    _check(got, _loop(B, 1, S, lambda b, t, s: s <= offsets_B[b]))
    for b, p in enumerate(offsets_B):
        np.testing.assert_array_equal(np.asarray(got)[b, 0, 0], full[0, 0, p])
    # Several queries per row: row b covers positions offsets_B[b] .. offsets_B[b] + T - 1.
    offsets_B = np.array([0, 1, 2])
    want = _loop(B, T, S, lambda b, t, s: s <= offsets_B[b] + t)
    _check(masks.causal(T, S, offset=offsets_B), want)


@pytest.mark.parametrize("window", [1, 2, 3, 10])
def test_sliding_window(window):
    want = _loop(1, S, S, lambda b, t, s: t - window < s <= t)
    _check(masks.sliding_window(S, S, window=window), want)
    _check(masks.sliding_window(S, window=window), want)
    # Each query sees min(window, t + 1) keys.
    got = np.asarray(masks.sliding_window(S, window=window))
    np.testing.assert_array_equal(got.sum(-1)[0, 0], np.minimum(window, np.arange(S) + 1))


def test_sliding_window_large_window_is_causal():
    np.testing.assert_array_equal(
        np.asarray(masks.sliding_window(S, window=S)), np.asarray(masks.causal(S))
    )


def test_sliding_window_offsets():
    window = 3
    full = np.asarray(masks.sliding_window(S, S, window=window))
    for p in range(S):
        got = np.asarray(masks.sliding_window(1, S, window=window, offset=p))
        np.testing.assert_array_equal(got, full[:, :, p : p + 1])
    offsets_B = np.array([2, 5, 0])
    got = masks.sliding_window(1, S, window=window, offset=offsets_B)
    _check(got, _loop(B, 1, S, lambda b, t, s: offsets_B[b] - window < s <= offsets_B[b]))
    for b, p in enumerate(offsets_B):
        np.testing.assert_array_equal(np.asarray(got)[b, 0, 0], full[0, 0, p])
    offsets_B = np.array([0, 1, 2])
    want = _loop(B, T, S, lambda b, t, s: offsets_B[b] + t - window < s <= offsets_B[b] + t)
    _check(masks.sliding_window(T, S, window=window, offset=offsets_B), want)


@pytest.mark.parametrize("window", [0, -2])
def test_sliding_window_rejects_small_window(window):
    with pytest.raises(ValueError, match=rf"window must be >= 1, got {window}"):
        masks.sliding_window(S, window=window)


def test_prefix_lm():
    prefix_B = np.array([0, 2, 4])
    want = _loop(B, S, S, lambda b, t, s: s < prefix_B[b] or s <= t)
    _check(masks.prefix_lm(prefix_B, S, S), want)
    _check(masks.prefix_lm(prefix_B, S), want)
    # A zero-length prefix is plain causal.
    np.testing.assert_array_equal(np.asarray(masks.prefix_lm(prefix_B, S))[0:1], masks.causal(S))


def test_prefix_lm_offsets():
    prefix_B = np.array([1, 3, 5])
    full = np.asarray(masks.prefix_lm(prefix_B, S, S))
    for p in range(S):
        got = np.asarray(masks.prefix_lm(prefix_B, 1, S, offset=p))
        np.testing.assert_array_equal(got, full[:, :, p : p + 1])
    offsets_B = np.array([0, 2, 5])
    got = masks.prefix_lm(prefix_B, 1, S, offset=offsets_B)
    _check(got, _loop(B, 1, S, lambda b, t, s: s < prefix_B[b] or s <= offsets_B[b]))
    for b, p in enumerate(offsets_B):
        np.testing.assert_array_equal(np.asarray(got)[b, 0, 0], full[b, 0, p])


# --------------------------------------------------------------------------------------------
# Padding, cross, segment
# --------------------------------------------------------------------------------------------

Q_VALID_BT = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], bool)
K_VALID_BS = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 1, 0]], bool)


def test_lengths_to_valid():
    want = np.array([[i < n for i in range(S)] for n in (6, 3, 0)])
    np.testing.assert_array_equal(np.asarray(masks.lengths_to_valid(np.array([6, 3, 0]), S)), want)


def test_padding_keys():
    _check(masks.padding(k_valid_BS=K_VALID_BS), _loop(B, 1, S, lambda b, t, s: K_VALID_BS[b, s]))


def test_padding_queries():
    _check(masks.padding(Q_VALID_BT), _loop(B, T, 1, lambda b, t, s: Q_VALID_BT[b, t]))


@pytest.mark.parametrize("fn", [masks.padding, masks.cross])
def test_padding_queries_and_keys(fn):
    want = _loop(B, T, S, lambda b, t, s: Q_VALID_BT[b, t] and K_VALID_BS[b, s])
    _check(fn(Q_VALID_BT, K_VALID_BS), want)


def test_padding_none():
    assert masks.padding() is None
    assert masks.padding_from_lengths() is None


def test_padding_from_lengths():
    q_len_B, k_len_B = np.array([4, 2, 1]), np.array([6, 3, 0])
    want = _loop(B, T, S, lambda b, t, s: t < q_len_B[b] and s < k_len_B[b])
    _check(masks.padding_from_lengths(q_len_B, k_len_B, T=T, S=S), want)
    k_only = _loop(B, 1, S, lambda b, t, s: s < k_len_B[b])
    _check(masks.padding_from_lengths(k_lengths_B=k_len_B, S=S), k_only)
    q_only = _loop(B, T, 1, lambda b, t, s: t < q_len_B[b])
    _check(masks.padding_from_lengths(q_len_B, T=T), q_only)


def test_segment_packed_documents():
    # Three packed rows; 0 marks padding.
    ids_BS = np.array([[1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 0, 0], [1, 2, 3, 4, 5, 6]])
    want = _loop(B, S, S, lambda b, t, s: ids_BS[b, t] == ids_BS[b, s] and ids_BS[b, t] > 0)
    _check(masks.segment(ids_BS), want)
    _check(masks.segment(ids_BS, ids_BS), want)
    # Padding never attends and is never attended to, even by itself.
    got = np.asarray(masks.segment(ids_BS))
    assert not got[1, 0, 4:].any() and not got[1, 0, :, 4:].any()


def test_segment_queries_and_keys_differ():
    q_ids_BT = np.array([[1, 2, 2, 0], [0, 1, 1, 1], [3, 3, 1, 2]])
    k_ids_BS = np.array([[1, 1, 2, 2, 0, 0], [1, 0, 0, 1, 1, 1], [1, 2, 3, 3, 3, 0]])
    want = _loop(B, T, S, lambda b, t, s: q_ids_BT[b, t] == k_ids_BS[b, s] and q_ids_BT[b, t] > 0)
    _check(masks.segment(q_ids_BT, k_ids_BS), want)


def test_segment_combined_with_causal():
    ids_BS = np.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1]])
    want = _loop(B, S, S, lambda b, t, s: s <= t and ids_BS[b, t] == ids_BS[b, s] > 0)
    _check(masks.combine(masks.causal(S), masks.segment(ids_BS)), want)


# --------------------------------------------------------------------------------------------
# combine
# --------------------------------------------------------------------------------------------


def test_combine():
    k_len_B = np.array([6, 3, 1])
    want = _loop(B, S, S, lambda b, t, s: s <= t and t - 2 < s and s < k_len_B[b])
    got = masks.combine(
        masks.causal(S),
        None,
        masks.sliding_window(S, window=2),
        masks.padding_from_lengths(k_lengths_B=k_len_B, S=S),
    )
    _check(got, want)


def test_combine_none_handling():
    assert masks.combine() is None
    assert masks.combine(None, None) is None
    causal = masks.causal(S)
    only = masks.combine(None, causal, None)
    assert only.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(only), np.asarray(causal))
    # Non-boolean masks, first or later, are read as booleans (any non-zero = may attend).
    ints = 2 * np.asarray(causal, np.int32)
    np.testing.assert_array_equal(np.asarray(masks.combine(ints)), causal)
    got = masks.combine(causal, ints, np.full((1, 1, 1, S), 3))
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got), causal)


def test_combine_with_per_head_mask():
    heads_BNTS = np.random.default_rng(0).random((B, N, S, S)) < 0.5
    got = masks.combine(masks.causal(S), jnp.asarray(heads_BNTS))
    _check(got, heads_BNTS & np.tril(np.ones((S, S), bool))[None, None])


# --------------------------------------------------------------------------------------------
# MaskSpec: the same masks as descriptions
# --------------------------------------------------------------------------------------------

OFFSETS_B = np.array([0, 1, 2])
SEGMENTS_BS = np.array([[1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 0, 0], [1, 2, 2, 2, 3, 3]])
PREFIX_B = np.array([0, 2, 4])
K_LEN_B = np.array([6, 3, 1])

SPEC_CASES = {  # name: (MaskSpec, the same mask from the functions above)
    "causal": (MaskSpec.for_sequence(S, causal=True), masks.causal(S)),
    "causal_T_S_offsets": (
        MaskSpec.for_sequence(T, S, causal=True, offset=OFFSETS_B),
        masks.causal(T, S, offset=OFFSETS_B),
    ),
    "sliding_window": (
        MaskSpec.for_sequence(S, causal=True, window=2),
        masks.sliding_window(S, window=2),
    ),
    "window_offsets": (
        MaskSpec.for_sequence(T, S, window=3, offset=OFFSETS_B),
        masks.sliding_window(T, S, window=3, offset=OFFSETS_B),
    ),
    "segments": (MaskSpec.for_sequence(S, segment_ids=SEGMENTS_BS), masks.segment(SEGMENTS_BS)),
    "segments_differ": (
        MaskSpec.for_sequence(T, S, segment_ids=SEGMENTS_BS[:, :T], k_segment_ids=SEGMENTS_BS),
        masks.segment(SEGMENTS_BS[:, :T], SEGMENTS_BS),
    ),
    "prefix_lm_offsets": (
        MaskSpec.for_sequence(
            1, S, causal=True, prefix_length=PREFIX_B, offset=np.array([0, 2, 5])
        ),
        masks.prefix_lm(PREFIX_B, 1, S, offset=np.array([0, 2, 5])),
    ),
    "padding": (
        MaskSpec.for_sequence(T, S, q_valid=Q_VALID_BT, k_valid=K_VALID_BS),
        masks.padding(Q_VALID_BT, K_VALID_BS),
    ),
    "lengths": (
        MaskSpec.for_sequence(T, S, k_length=K_LEN_B),
        masks.padding_from_lengths(k_lengths_B=K_LEN_B, S=S),
    ),
    "causal_window_segments_padding": (
        MaskSpec.for_sequence(
            S, causal=True, window=3, segment_ids=SEGMENTS_BS, k_valid=K_VALID_BS
        ),
        masks.combine(
            masks.causal(S),
            masks.sliding_window(S, window=3),
            masks.segment(SEGMENTS_BS),
            masks.padding(k_valid_BS=K_VALID_BS),
        ),
    ),
    "prefix_lm_lengths": (
        MaskSpec.for_sequence(S, causal=True, prefix_length=PREFIX_B, k_length=K_LEN_B),
        masks.combine(
            masks.prefix_lm(PREFIX_B, S), masks.padding_from_lengths(k_lengths_B=K_LEN_B, S=S)
        ),
    ),
    "cache": (  # T new queries at each row's length, over S slots
        MaskSpec.for_cache(2, S, np.array([0, 3, 4]), window=2),
        masks.combine(
            masks.causal(2, S, offset=np.array([0, 3, 4])),
            masks.sliding_window(2, S, window=2, offset=np.array([0, 3, 4])),
            masks.padding_from_lengths(k_lengths_B=np.array([2, 5, 6]), S=S),
        ),
    ),
    "nothing": (MaskSpec.for_sequence(T, S), np.ones((1, 1, T, S), bool)),
}


@pytest.mark.parametrize("case", SPEC_CASES)
def test_mask_spec_dense_equals_the_mask_functions(case):
    spec, want = SPEC_CASES[case]
    got = spec.dense()
    assert got.shape[2:] == spec.shape and got.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(np.asarray(want), got.shape))
    assert got.shape[1] == 1 and got.shape[0] in (1, B)


@pytest.mark.parametrize("case", ["causal_window_segments_padding", "cache", "padding"])
def test_mask_spec_blocks_are_slices_of_the_dense_mask(case):
    spec, _ = SPEC_CASES[case]
    dense = np.asarray(spec.dense())
    T_, S_ = spec.shape
    for q0, tq in ((0, T_), (T_ - 1, 1), (1, T_ - 1)):
        for k0, tk in ((0, S_), (S_ - 2, 2), (1, 3)):
            got = np.asarray(spec.block(q0, tq, k0, tk))
            np.testing.assert_array_equal(got, dense[:, :, q0 : q0 + tq, k0 : k0 + tk])


def _random_spec(rng, T_, S_, causal):
    """A spec with random positions (cache offsets), window, segments, lengths, validity."""
    return MaskSpec.for_sequence(
        T_,
        S_,
        causal=causal,
        window=int(rng.integers(1, 8)) if rng.random() < 0.5 else None,
        segment_ids=np.sort(rng.integers(0, 4, (B, T_)), axis=1),
        k_segment_ids=np.sort(rng.integers(0, 4, (B, S_)), axis=1),
        k_valid=rng.random((B, S_)) < 0.8,
        q_valid=rng.random((B, T_)) < 0.9,
        k_length=rng.integers(0, S_ + 1, (B,)),
        prefix_length=rng.integers(0, 5, (B,)) if causal else None,
        offset=rng.integers(0, S_ - T_ + 1, (B,)),
    )


def test_block_any_never_rules_out_an_allowed_block():
    """False in block_any means no allowed entry (so skipping is exact); for plain causal
    masks it is exactly the blocks that hold one."""
    rng = np.random.default_rng(0)
    tq, tk = 4, 4
    for trial in range(12):
        spec = _random_spec(rng, 8, 16, causal=trial % 2 == 0)
        dense = np.asarray(spec.dense()).reshape(B, 2, tq, 4, tk)
        holds = dense.any(axis=(0, 2, 4))  # [nq, nk]
        got = np.asarray(spec.block_any(tq, tk))
        assert got.shape == (2, 4)
        assert not (holds & ~got).any(), trial
    for spec in (MaskSpec.for_sequence(16, causal=True), SPEC_CASES["cache"][0].padded(4, 8)):
        T_, S_ = spec.shape
        holds = np.asarray(spec.dense()).reshape(-1, T_ // 2, 2, S_ // 4, 4).any(axis=(0, 2, 4))
        np.testing.assert_array_equal(np.asarray(spec.block_any(2, 4)), holds)


def test_mask_spec_padded_keeps_the_mask():
    spec, _ = SPEC_CASES["causal_window_segments_padding"]
    padded = spec.padded(8, 12)
    assert padded.shape == (8, 12)
    np.testing.assert_array_equal(
        np.asarray(padded.dense())[:, :, :S, :S], np.asarray(spec.dense())
    )


def test_mask_spec_traced_window_inside_a_scan():
    """Per-layer windows are data: one scan over layers builds each layer's mask."""
    spec = MaskSpec.for_sequence(S, causal=True)
    windows = jnp.array([1, 3, np.iinfo(np.int32).max], jnp.int32)

    def layer(carry, window):
        return carry, spec.replace(window=window).dense()

    _, got = jax.jit(lambda w: jax.lax.scan(layer, 0, w))(windows)
    for i, window in enumerate((1, 3, S)):
        np.testing.assert_array_equal(
            np.asarray(got[i]), np.asarray(masks.sliding_window(S, window=window))
        )


def test_mask_spec_rejects_bad_fields():
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        MaskSpec.for_sequence(S, causal=True, window=0)
    with pytest.raises(ValueError, match="prefix_length relaxes the causal rule"):
        MaskSpec.for_sequence(S, prefix_length=PREFIX_B)
    with pytest.raises(ValueError, match="pass k_segment_ids"):
        MaskSpec.for_sequence(T, S, segment_ids=SEGMENTS_BS[:, :T])
    with pytest.raises(ValueError, match="multiples"):
        MaskSpec.for_sequence(S).block_any(4, 4)
