"""``implementation="chunked"`` against the float64 reference and the reference implementation.

Values are checked against ``tests/reference.py`` (float64 NumPy); gradients (q, k, v and a
dense bias or a ``PositionBias``'s parameters) against ``jax.grad`` of the reference
implementation on the same dense mask and bias, which ``MaskSpec.dense()`` /
``PositionBias.dense()`` give. Small blocks (8 x 16) over lengths that are not multiples of
them exercise the padding, the skipped blocks and the online softmax across many blocks.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from attnlab.ops import MaskSpec, PositionBias, dot_product_attention, positions

B, H = 2, 8
BLOCKS = dict(block_q=8, block_k=16)
TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 3e-2, "atol": 3e-2}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def _qkv(seed, T, S, N, K, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


NO_WINDOW = np.iinfo(np.int32).max


def _spec(
    T,
    S,
    *,
    causal=True,
    offset_B=(0, 0),
    window=None,
    segment_BT=None,
    k_segment_BS=None,
    k_valid_BS=None,
    q_valid_BT=None,
    k_length_B=None,
    prefix_B=None,
):
    """A MaskSpec with every field present (neutral values for those not given), so cases
    that differ only in data share one compiled program."""
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    ones = lambda *shape: jnp.ones(shape, jnp.int32)
    q_seg = ones(B, T) if segment_BT is None else i32(segment_BT)
    k_seg = q_seg if segment_BT is not None and k_segment_BS is None else ones(B, S)
    k_seg = k_seg if k_segment_BS is None else i32(k_segment_BS)
    return MaskSpec(
        q_pos=i32(np.asarray(offset_B)[:, None] + np.arange(T)[None]),
        k_pos=i32(np.arange(S)[None]),
        causal=causal,
        window=i32(NO_WINDOW if window is None else window),
        q_segment=q_seg,
        k_segment=k_seg,
        k_length=i32([S, S] if k_length_B is None else k_length_B),
        k_valid=jnp.asarray(np.ones((B, S), bool) if k_valid_BS is None else k_valid_BS),
        q_valid=jnp.asarray(np.ones((B, T), bool) if q_valid_BT is None else q_valid_BT),
        prefix_length=i32([0, 0] if prefix_B is None else prefix_B),
    )


def _dense(mask):
    return mask.dense() if isinstance(mask, MaskSpec) else mask


def _loss(implementation, q, k, v, w, mask, bias, blocks=None):
    out = dot_product_attention(
        q, k, v, mask=mask, bias=bias, implementation=implementation, **(blocks or {})
    )
    return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out


@functools.partial(jax.jit, static_argnames=("grad_bias",))
def _chunked_and_reference(q, k, v, w, mask, bias=None, grad_bias=False):
    """(out, grads) of the chunked path on ``mask``/``bias`` and of the reference on their
    dense forms; grads are wrt q, k, v (and the bias, or a PositionBias's params)."""
    argnums = (0, 1, 2, 3) if grad_bias else (0, 1, 2)
    described = isinstance(bias, PositionBias)
    as_bias = (lambda p: bias.replace(params=p)) if described else (lambda b: b)
    diff_bias = bias.params if described else bias

    def chunked(q, k, v, b):
        return _loss("chunked", q, k, v, w, mask, as_bias(b), BLOCKS)

    def dense(q, k, v, b):
        b = as_bias(b)
        return _loss("reference", q, k, v, w, _dense(mask), b.dense() if described else b)

    results = []
    for fn in (chunked, dense):
        (_, out), grads = jax.value_and_grad(fn, argnums=argnums, has_aux=True)(q, k, v, diff_bias)
        results.append((out, grads))
    return results


def _check(q, k, v, w, mask, bias=None, *, grad_bias=False, tol=TOL):
    (got, got_grads), (want, want_grads) = _chunked_and_reference(q, k, v, w, mask, bias, grad_bias)
    dense_bias = bias.dense() if isinstance(bias, PositionBias) else bias
    f64, _ = ref.attention(q, k, v, mask=_dense(mask), bias=dense_bias)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), f64, **tol)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    names = ("dq", "dk", "dv", "dbias")[: len(got_grads)]
    for name, g, h in zip(names, got_grads, want_grads, strict=True):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(h, np.float32), **tol, err_msg=name
        )
    return got, got_grads


T, S = 37, 45  # neither a multiple of the blocks
PACKED_BT = np.array([[1] * 10 + [2] * 20 + [3] * 7, [1] * 17 + [2] * 12 + [0] * 8])
CAUSAL_CASES = {
    "causal": {},
    "window": dict(window=11),
    "segments_padding": dict(
        segment_BT=PACKED_BT, k_valid_BS=np.arange(T)[None] < np.array([[T], [25]])
    ),
    "prefix_lm": dict(prefix_B=[0, 20]),
    "offsets_window_lengths": dict(offset_B=[0, 6], window=9, k_length_B=[T, 30]),
}


@pytest.mark.parametrize("kind", CAUSAL_CASES)
def test_causal_masks_gqa(kind):
    """Causal self-attention with windows, packed segments, padding and a prefix."""
    q, k, v, w = _qkv(0, T, T, 4, 2)
    _check(q, k, v, w, _spec(T, T, **CAUSAL_CASES[kind]))


@pytest.mark.parametrize(("starts", "window"), [((10, 40), None), ((0, 38), 7)])
def test_cache_offsets_mqa(starts, window):
    """T=5 new queries per row at ``starts`` over S=45 cache slots, written up to start + 5."""
    q, k, v, w = _qkv(1, 5, S, 4, 1)
    spec = MaskSpec.for_cache(5, S, np.array(starts), window=window)
    full = _spec(5, S, offset_B=starts, window=window, k_length_B=np.array(starts) + 5)
    np.testing.assert_array_equal(np.asarray(spec.dense()), np.asarray(full.dense()))
    _check(q, k, v, w, full)


def _q_valid():
    q_valid_BT = np.ones((B, 21), bool)
    q_valid_BT[1, 3:9] = False  # queries that see nothing
    return q_valid_BT


CROSS_CASES = {
    "all": {},
    "lengths_and_masked_queries": dict(k_length_B=[S, 13], q_valid_BT=_q_valid()),
    "segments_differ": dict(
        segment_BT=np.repeat([[1, 2, 3], [2, 0, 1]], 7, axis=1),
        k_segment_BS=np.repeat([[1, 2, 3], [1, 2, 3]], 15, axis=1),
    ),
}


@pytest.mark.parametrize("kind", CROSS_CASES)
def test_bidirectional_masks_t_differs_from_s_gqa(kind):
    q, k, v, w = _qkv(2, 21, S, 4, 2)
    _check(q, k, v, w, _spec(21, S, causal=False, **CROSS_CASES[kind]))


def test_dense_masks_mha_fully_masked_rows_zero_with_zero_gradients():
    """A dense per-head mask (sliced per block) where some rows, then all, see nothing."""
    q, k, v, w = _qkv(4, 21, T, 4, 4)
    mask_BNTS = np.random.default_rng(5).random((B, 4, 21, T)) < 0.3
    mask_BNTS[0, :, :5] = False
    out, (dq, _, _) = _check(q, k, v, w, jnp.asarray(mask_BNTS))
    np.testing.assert_array_equal(np.asarray(out)[0, :5], 0.0)
    np.testing.assert_array_equal(np.asarray(dq)[0, :5], 0.0)
    out, grads = _check(q, k, v, w, jnp.zeros((B, 4, 21, T), bool))
    for x in (out, *grads):
        np.testing.assert_array_equal(np.asarray(x), 0.0)


def test_no_mask_dense_bias_mha_and_jax_nn():
    """A bias shared by the batch (its gradient summed over it), no mask: also jax.nn."""
    q, k, v, w = _qkv(3, T, S, 4, 4)
    bias = jnp.asarray(np.random.default_rng(7).standard_normal((1, 4, T, S)), jnp.float32)
    out, _ = _check(q, k, v, w, None, bias, grad_bias=True)
    want = jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)


def test_alibi_as_a_function_of_positions():
    q, k, v, w = _qkv(8, T, T, 4, 2)
    pos_BT = jnp.broadcast_to(jnp.arange(T)[None], (B, T)) + jnp.array([[0], [5]])
    bias = PositionBias.alibi(positions.alibi_slopes(4), pos_BT, pos_BT)
    np.testing.assert_allclose(
        np.asarray(bias.dense()), ref.alibi_bias(ref.alibi_slopes(4), pos_BT, pos_BT), **TOL
    )
    _check(q, k, v, w, _spec(T, T), bias)


def test_relative_bias_as_a_function_of_positions_with_table_gradient():
    q, k, v, w = _qkv(9, 21, S, 4, 4)
    table_XN = jnp.asarray(np.random.default_rng(10).standard_normal((8, 4)), jnp.float32)
    q_pos = jnp.broadcast_to(jnp.arange(21)[None] + 12, (B, 21))
    k_pos = jnp.arange(S)[None]
    bias = PositionBias.relative(table_XN, q_pos, k_pos, bidirectional=True, max_distance=20)
    want = positions.relative_position_bias(table_XN, q_pos, k_pos, max_distance=20)
    np.testing.assert_array_equal(np.asarray(bias.dense()), np.asarray(want))
    spec = _spec(21, S, causal=False, **CROSS_CASES["lengths_and_masked_queries"])
    _, grads = _check(q, k, v, w, spec, bias, grad_bias=True)
    assert np.abs(np.asarray(grads[3])).max() > 0  # the table learns


def test_bfloat16_inputs_float32_accumulation_and_a_key_bias():
    """bf16 in and out; with a [B, 1, 1, S] bias (a key-padding style bias, broadcast over
    heads and queries, its gradient summed over them)."""
    q, k, v, w = _qkv(11, T, T, 4, 2, dtype=jnp.bfloat16)
    bias = jnp.asarray(np.random.default_rng(12).standard_normal((B, 1, 1, T)), jnp.bfloat16)
    out, grads = _check(q, k, v, w, _spec(T, T, window=11), bias, grad_bias=True, tol=BF16_TOL)
    assert out.dtype == jnp.bfloat16
    assert all(g.dtype == jnp.bfloat16 for g in grads)


def test_default_blocks_and_the_other_implementations_read_descriptions():
    """MaskSpec and PositionBias work with every implementation (dense ones call .dense())."""
    q, k, v, _ = _qkv(12, T, T, 4, 2)
    spec = MaskSpec.for_sequence(T, causal=True, segment_ids=PACKED_BT, window=11)
    bias = PositionBias.alibi(positions.alibi_slopes(4), jnp.arange(T)[None], jnp.arange(T)[None])
    want, _ = ref.attention(q, k, v, mask=spec.dense(), bias=bias.dense())

    @jax.jit
    def every_path(q, k, v, spec, bias):
        attend = functools.partial(dot_product_attention, q, k, v, mask=spec, bias=bias)
        outs = {impl: attend(implementation=impl) for impl in ("reference", "xla", "chunked")}
        outs["weights"] = attend(implementation="chunked", return_weights=True)[1]
        return outs

    outs = every_path(q, k, v, spec, bias)
    for name, got in outs.items():
        if name != "weights":
            np.testing.assert_allclose(np.asarray(got), want, **TOL, err_msg=name)
    assert outs["weights"].shape == (B, 4, T, T)  # return_weights runs the reference path


def test_unsupported_options_raise_naming_the_fix():
    q, k, v, _ = _qkv(13, 5, 5, 4, 2)
    with pytest.raises(ValueError, match="logits_fn.*implementation='reference'"):
        dot_product_attention(q, k, v, implementation="chunked", logits_fn=lambda s: s)
    with pytest.raises(ValueError, match="dropout.*set the rate to 0"):
        dot_product_attention(
            q, k, v, implementation="chunked", dropout_rate=0.1, dropout_key=jax.random.key(0)
        )
    with pytest.raises(ValueError, match="block_q/block_k.*'xla' has none.*'chunked'"):
        dot_product_attention(q, k, v, implementation="xla", block_q=8)
    with pytest.raises(ValueError, match="block_k=0 must be a positive integer"):
        dot_product_attention(q, k, v, implementation="chunked", block_k=0)
    with pytest.raises(ValueError, match="MaskSpec covers"):
        dot_product_attention(q, k, v, mask=MaskSpec.for_sequence(6), implementation="chunked")
    with pytest.raises(ValueError, match="scale"):
        jax.jit(lambda s: dot_product_attention(q, k, v, scale=s, implementation="chunked"))(0.5)
