"""``attnlab.ops.dot_product_attention`` against the float64 reference in ``tests/reference.py``.

On CPU most of the cost is compiling each new shape, so most checks run every path at once
through one jitted function (``_all_paths``) and reuse a few shapes; ``test_jit_matches_eager``
covers the eager path.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from attnlab.ops import IMPLEMENTATIONS, dot_product_attention, masks, paths

B, T, S, H = 2, 5, 7, 8
TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 3e-2, "atol": 3e-2}
# Implementations that run on CPU; "cudnn" needs a GPU.
CPU_IMPLEMENTATIONS = ("reference", "xla")
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def _qkv(seed, N, K, *, H=H, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q_BTNH = rng.standard_normal((B, T, N, H))
    k_BSKH = rng.standard_normal((B, S, K, H))
    v_BSKH = rng.standard_normal((B, S, K, H))
    return tuple(jnp.asarray(a, dtype) for a in (q_BTNH, k_BSKH, v_BSKH))


def _mask(kind, N, *, seed=0):
    """A mask of the named kind, broadcastable to [B, N, T, S]."""
    rng = np.random.default_rng(seed)
    if kind is None:
        return None
    if kind == "causal":  # the T queries are the last T of the S keys
        return masks.causal(T, S, offset=S - T)
    if kind == "padding":
        return masks.padding_from_lengths(k_lengths_B=np.array([S, 3]), S=S)
    if kind == "random":  # one mask per head
        mask_BNTS = rng.random((B, N, T, S)) < 0.6
        mask_BNTS[:, :, :, 0] = True  # every row keeps at least one key
        return jnp.asarray(mask_BNTS)
    if kind == "random_sparse":  # shared by the heads; some rows have no key at all
        mask_B1TS = rng.random((B, 1, T, S)) < 0.3
        mask_B1TS[0, 0, 0] = False
        mask_B1TS[1, 0, 2, 3] = True
        return jnp.asarray(mask_B1TS)
    raise AssertionError(kind)


def _check_weights(weights_BNTS, mask):
    """Weights are zero on masked keys and sum to 1 over the allowed keys of each row."""
    weights_BNTS = np.asarray(weights_BNTS)
    allowed_BNTS = np.ones(weights_BNTS.shape, bool)
    if mask is not None:
        allowed_BNTS = np.broadcast_to(np.asarray(mask), weights_BNTS.shape)
    assert np.all(weights_BNTS[~allowed_BNTS] == 0.0)
    assert np.all(weights_BNTS >= 0.0)
    has_key_BNT = allowed_BNTS.any(-1)
    np.testing.assert_allclose(weights_BNTS.sum(-1)[has_key_BNT], 1.0, **TOL)
    assert np.all(weights_BNTS.sum(-1)[~has_key_BNT] == 0.0)


CASES = [
    ("mha", None),
    ("mha", "random_sparse"),
    ("gqa", "causal"),
    ("gqa", "padding"),
    ("gqa", "random"),
    ("gqa", "random_sparse"),
    ("mqa", "causal"),
    ("mqa", "random"),
]


@functools.partial(jax.jit, static_argnames=("scale",))
def _all_paths(q, k, v, mask=None, bias=None, scale=None):
    """({path: out}, weights) for every CPU implementation, and the weights-returning call."""
    outs = {
        impl: dot_product_attention(q, k, v, mask=mask, bias=bias, scale=scale, implementation=impl)
        for impl in CPU_IMPLEMENTATIONS
    }
    out, weights = dot_product_attention(
        q, k, v, mask=mask, bias=bias, scale=scale, return_weights=True
    )
    return outs | {"with_weights": out}, weights


def _check_all_paths(q, k, v, mask=None, bias=None, scale=None, tol=TOL):
    """Every path equals the float64 reference; returns the outputs and weights."""
    want_out, want_weights = ref.attention(q, k, v, mask=mask, bias=bias, scale=scale)
    outs, weights = _all_paths(q, k, v, mask, bias, scale=scale)
    for name, got in outs.items():
        assert got.shape == q.shape and got.dtype == q.dtype, name
        np.testing.assert_allclose(
            np.asarray(got.astype(jnp.float32)), want_out, **tol, err_msg=name
        )
    assert weights.shape == (q.shape[0], q.shape[2], q.shape[1], k.shape[1])  # [B, N, T, S]
    assert weights.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(weights), want_weights, **tol)
    _check_weights(weights, mask)
    return {name: np.asarray(out.astype(jnp.float32)) for name, out in outs.items()}, weights


@pytest.mark.parametrize(("heads", "mask_kind"), CASES)
def test_matches_float64_reference(heads, mask_kind):
    """Each CPU implementation (and return_weights) equals the float64 reference."""
    N, K = HEADS[heads]
    q, k, v = _qkv(1, N, K)
    outs, _ = _check_all_paths(q, k, v, _mask(mask_kind, N))
    np.testing.assert_allclose(outs["xla"], outs["reference"], **TOL)


@pytest.mark.parametrize(
    ("heads", "bias_shape"), [("gqa", (1, 1, T, S)), ("gqa", (B, 4, T, S)), ("mha", (1, 4, 1, S))]
)
def test_bias_matches_reference(heads, bias_shape):
    N, K = HEADS[heads]
    q, k, v = _qkv(2, N, K)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal(bias_shape), jnp.float32)
    _check_all_paths(q, k, v, _mask("causal", N), bias)


def test_explicit_scale():
    q, k, v = _qkv(4, 4, 2)
    _check_all_paths(q, k, v, _mask("causal", 4), scale=0.3)


def test_logits_fn_hook():
    q, k, v = _qkv(12, 4, 2)
    mask = _mask("random_sparse", 4)
    plain = dot_product_attention(q, k, v, mask=mask)
    identity = dot_product_attention(q, k, v, mask=mask, logits_fn=lambda x: x)
    np.testing.assert_allclose(np.asarray(identity), np.asarray(plain), **TOL)
    # Doubling the logits is the same as doubling the scale.
    doubled = dot_product_attention(q, k, v, mask=mask, logits_fn=lambda x: 2.0 * x)
    want, _ = ref.attention(q, k, v, mask=mask, scale=2.0 * H**-0.5)
    np.testing.assert_allclose(np.asarray(doubled), want, **TOL)


def test_jit_matches_eager():
    q, k, v = _qkv(13, 4, 2)
    mask = _mask("random_sparse", 4)
    jitted, weights = _all_paths(q, k, v, mask)
    for implementation in CPU_IMPLEMENTATIONS:
        eager = dot_product_attention(q, k, v, mask=mask, implementation=implementation)
        np.testing.assert_allclose(np.asarray(jitted[implementation]), np.asarray(eager), **TOL)
    # "auto" lets jax.nn choose; on CPU that is the XLA path.
    auto = dot_product_attention(q, k, v, mask=mask, implementation="auto")
    np.testing.assert_allclose(np.asarray(auto), np.asarray(jitted["reference"]), **TOL)
    # return_weights with a fused implementation still returns the reference pair.
    out, eager_weights = dot_product_attention(
        q, k, v, mask=mask, return_weights=True, implementation="xla"
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(jitted["reference"]), **TOL)
    np.testing.assert_allclose(np.asarray(eager_weights), np.asarray(weights), **TOL)


# --------------------------------------------------------------------------------------------
# The worked example
# --------------------------------------------------------------------------------------------

X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=np.float64)
# Rows are output dimensions: Q = X W_Q^T.
W_Q = np.array([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=np.float64)
W_K = np.array([[0, 1, 1, 0], [1, 0, 0, 1]], dtype=np.float64)
W_V = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], dtype=np.float64)


def test_worked_example_by_hand():
    Q, K, V = X @ W_Q.T, X @ W_K.T, X @ W_V.T
    np.testing.assert_array_equal(Q, [[2, 0], [0, 2], [1, 1], [1, 1]])
    np.testing.assert_array_equal(K, [[1, 1], [1, 1], [1, 1], [1, 1]])
    np.testing.assert_array_equal(V, [[1, 1], [1, 1], [2, 0], [0, 2]])
    scores = Q @ K.T  # unscaled: every query gives every key the same score, 2
    np.testing.assert_array_equal(scores, np.full((4, 4), 2.0))
    weights = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, np.full((4, 4), 0.25))
    # The output is the plain mean of the value rows: [(1+1+2+0)/4, (1+1+0+2)/4].
    np.testing.assert_allclose(weights @ V, np.ones((4, 2)))
    out, _ = ref.attention(Q[None, :, None], K[None, :, None], V[None, :, None], scale=1.0)
    np.testing.assert_allclose(out[0, :, 0], np.ones((4, 2)))


def test_worked_example_through_attnlab():
    as_BTNH = lambda w: jnp.asarray((X @ w.T)[None, :, None], jnp.float32)  # noqa: E731
    outs, weights_BNTS = _all_paths(as_BTNH(W_Q), as_BTNH(W_K), as_BTNH(W_V), scale=1.0)
    for name, out_BTNH in outs.items():
        assert out_BTNH.shape == (1, 4, 1, 2)
        np.testing.assert_allclose(
            np.asarray(out_BTNH[0, :, 0]), np.ones((4, 2)), **TOL, err_msg=name
        )
    np.testing.assert_allclose(np.asarray(weights_BNTS), np.full((1, 1, 4, 4), 0.25), **TOL)


# --------------------------------------------------------------------------------------------
# Fully masked rows
# --------------------------------------------------------------------------------------------


def _row0_masked_mask():
    """[B, 1, T, S] causal mask in which query 0 of batch row 0 sees nothing (a padded query)."""
    q_valid_BT = np.ones((B, T), bool)
    q_valid_BT[0, 0] = False
    return masks.combine(masks.causal(T, S, offset=S - T), masks.padding(q_valid_BT))


@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_fully_masked_row_is_zero(heads):
    N, K = HEADS[heads]
    q, k, v = _qkv(14, N, K)
    mask = _row0_masked_mask()
    want, _ = ref.attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(want[0, 0], 0.0)
    outs, weights = _check_all_paths(q, k, v, mask)
    for name, out in outs.items():
        assert np.isfinite(out).all(), name
        np.testing.assert_array_equal(out[0, 0], 0.0, err_msg=name)
    np.testing.assert_array_equal(np.asarray(weights)[0, :, 0], 0.0)
    # An all-False mask gives zeros everywhere.
    outs, _ = _check_all_paths(q, k, v, jnp.zeros((B, 1, T, S), bool))
    for name, out in outs.items():
        np.testing.assert_array_equal(out, 0.0, err_msg=name)


@functools.partial(jax.jit, static_argnames=("implementation",))
@functools.partial(jax.grad, argnums=(0, 1, 2))
def _grads(q, k, v, mask, w, implementation):
    """Gradients wrt q, k, v of sum(attention(q, k, v) * w)."""
    out = dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    return jnp.sum(out * w)


def test_fully_masked_row_gradients_are_finite():
    q, k, v = _qkv(15, 4, 2)
    mask = _row0_masked_mask()
    w = jnp.asarray(np.random.default_rng(16).standard_normal((B, T, 4, H)), jnp.float32)
    grads = {impl: _grads(q, k, v, mask, w, implementation=impl) for impl in CPU_IMPLEMENTATIONS}
    for implementation, (dq, dk, dv) in grads.items():
        for g in (dq, dk, dv):
            assert np.isfinite(np.asarray(g)).all(), implementation
        # The masked query does not affect the loss; the others do.
        np.testing.assert_array_equal(np.asarray(dq)[0, 0], 0.0)
        assert np.abs(np.asarray(dq)[1]).sum() > 0
    for g, h in zip(grads["reference"], grads["xla"], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), **TOL)


def test_all_masked_gradients_are_zero():
    q, k, v = _qkv(17, 4, 2)
    nothing = jnp.zeros((B, 1, T, S), bool)
    w = jnp.ones((B, T, 4, H), jnp.float32)
    for implementation in CPU_IMPLEMENTATIONS:
        for g in _grads(q, k, v, nothing, w, implementation=implementation):
            np.testing.assert_array_equal(np.asarray(g), 0.0)


# --------------------------------------------------------------------------------------------
# Low precision
# --------------------------------------------------------------------------------------------


def test_bfloat16_close_to_float64():
    """bf16 in, bf16 out, float32 softmax: close to float64 on the same (rounded) inputs."""
    q, k, v = _qkv(18, 4, 2, dtype=jnp.bfloat16)
    # Unscaled logits a few units apart: a bfloat16 softmax would round the weights visibly.
    _, weights = _check_all_paths(q, k, v, _mask("causal", 4), scale=1.0, tol=BF16_TOL)
    assert weights.dtype == jnp.float32
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    _, want = ref.attention(*f32, mask=_mask("causal", 4), scale=1.0)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------


def test_heads_not_divisible_raises():
    q, k, v = _qkv(20, 4, 3)
    with pytest.raises(ValueError, match=r"N=4 must be a multiple of kv heads K=3"):
        dot_product_attention(q, k, v)


def test_head_dims_differ_raises():
    q, _, _ = _qkv(21, 4, 2, H=8)
    _, k, v = _qkv(21, 4, 2, H=6)
    with pytest.raises(ValueError, match=r"head dims differ: q H=8, k H=6"):
        dot_product_attention(q, k, v)


def test_k_v_shapes_differ_raises():
    q, k, v = _qkv(22, 4, 2)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        dot_product_attention(q, k, v[:, :-1])


def test_wrong_rank_raises():
    q, k, v = _qkv(23, 4, 2)
    with pytest.raises(ValueError, match=r"q \[B, T, N, H\]"):
        dot_product_attention(q[0], k, v)


def test_unknown_implementation_raises():
    q, k, v = _qkv(24, 4, 2)
    with pytest.raises(ValueError, match="'flash'.*unknown.*reference"):
        dot_product_attention(q, k, v, implementation="flash")
    assert set(CPU_IMPLEMENTATIONS) <= set(IMPLEMENTATIONS)


def test_mask_of_wrong_rank_raises():
    q, k, v = _qkv(25, 4, 2)
    with pytest.raises(ValueError, match="must be 4-D"):
        dot_product_attention(q, k, v, mask=jnp.ones((T, S), bool))


@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_one_query_path_matches_float64_reference(heads):
    """A single query per row (a decoding step) under ``"auto"`` on CPU runs
    ``one_query_attention``; it equals the float64 reference with a padding mask (row 1
    sees 3 keys), a per-head bias, and a row whose keys are all masked (zeros)."""
    from attnlab.ops.attention import one_query_attention

    N, K = HEADS[heads]
    rng = np.random.default_rng(21)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
               ((3, 1, N, H), (3, S, K, H), (3, S, K, H)))  # fmt: skip
    mask = jnp.asarray(np.arange(S)[None, None, None, :] < np.array([S, 3, 0])[:, None, None, None])
    bias = jnp.asarray(rng.standard_normal((1, N, 1, S)), jnp.float32)
    want, _ = ref.attention(q, k, v, mask=mask, bias=bias)
    assert np.all(want[2] == 0.0)
    for got in (
        jax.jit(lambda *a: one_query_attention(*a, mask=mask, bias=bias))(q, k, v),
        dot_product_attention(q, k, v, mask=mask, bias=bias, implementation="auto"),
    ):
        assert got.shape == q.shape and got.dtype == q.dtype
        np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_causal_spec_reaches_the_fused_kernel_as_a_flag(monkeypatch):
    """On a GPU backend a plain causal ``MaskSpec`` is handed to
    ``jax.nn.dot_product_attention`` as ``is_causal=True`` (no [T, S] mask array) and gives
    the float64 causal result (the XLA path, run here on the CPU, stands in for cuDNN)."""
    calls = []
    fused = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return fused(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    rng = np.random.default_rng(21)
    q, k, v = (jnp.asarray(rng.standard_normal((B, S, 4, H)), jnp.float32) for _ in range(3))
    spec = masks.MaskSpec.for_sequence(S, causal=True)
    out = dot_product_attention(q, k, v, mask=spec, implementation="xla", backend="gpu")
    assert calls[-1]["is_causal"] is True and calls[-1].get("mask") is None
    expected, _ = ref.attention(q, k, v, mask=np.tril(np.ones((S, S), bool)))
    np.testing.assert_allclose(np.asarray(out), expected, **TOL)
    # Any other rule keeps the dense mask (and the flag off), as does the CPU.
    padded = masks.MaskSpec.for_sequence(S, causal=True, k_valid=np.ones((B, S), bool))
    dot_product_attention(q, k, v, mask=padded, implementation="xla", backend="gpu")
    assert not calls[-1].get("is_causal") and calls[-1]["mask"].shape == (B, 1, S, S)
    dot_product_attention(q, k, v, mask=spec, implementation="xla", backend="cpu")
    assert not calls[-1].get("is_causal") and calls[-1]["mask"].shape == (B, 1, S, S)


def test_causal_only_needs_aligned_positions_and_no_other_rule():
    aligned = masks.MaskSpec.for_sequence(6, causal=True)
    assert aligned.causal_only
    assert not masks.MaskSpec.for_sequence(6).causal_only  # not causal
    assert not masks.MaskSpec.for_sequence(4, 6, causal=True).causal_only  # T != S
    assert not masks.MaskSpec.for_sequence(6, causal=True, offset=2).causal_only
    assert not masks.MaskSpec.for_sequence(6, causal=True, window=3).causal_only
    seg = np.array([[1, 1, 1, 2, 2, 2]])
    assert not masks.MaskSpec.for_sequence(6, causal=True, segment_ids=seg).causal_only
    assert not aligned.replace(q_pos=aligned.q_pos + 1).causal_only  # moved positions
    assert not masks.MaskSpec.for_cache(6, 6, np.zeros(1, np.int32)).causal_only


def test_auto_runs_cudnn_on_an_nvidia_gpu_only_where_measured(monkeypatch):
    """``"auto"`` picks cuDNN for plain causal bfloat16 self-attention on an NVIDIA GPU
    (the dispatch is checked here, on the CPU, with XLA's kernel run in cuDNN's place) and
    gives every case not measured there the Pallas GPU kernel."""
    from attnlab.ops import dense_attention

    calls = []
    fused = jax.nn.dot_product_attention

    def spy(*args, implementation=None, **kwargs):
        calls.append(dict(kwargs, implementation=implementation))
        return fused(*args, implementation="xla" if implementation else None, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    monkeypatch.setattr(dense_attention, "_nvidia_gpu", lambda: True)
    T64 = 64
    rng = np.random.default_rng(22)
    q, k, v = (jnp.asarray(rng.standard_normal((1, T64, 2, 16)), jnp.bfloat16) for _ in range(3))
    spec = masks.MaskSpec.for_sequence(T64, causal=True)

    def run(q=q, k=k, v=v, mask=spec, backend="gpu", **kw):
        calls.clear()
        out = dot_product_attention(
            q, k, v, mask=mask, implementation="auto", backend=backend, **kw
        )
        return out, calls[-1]["implementation"] if calls else "not fused"

    out, impl = run()
    assert impl == "cudnn" and calls[-1]["is_causal"] is True
    expected, _ = ref.attention(q, k, v, mask=np.tril(np.ones((T64, T64), bool)))
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, **BF16_TOL)
    assert run(backend="cpu")[1] != "cudnn"

    def path(q=q, k=k, v=v, mask=spec, **kw):  # what a GPU program runs: traced, not run
        f = lambda q, k, v: dot_product_attention(
            q, k, v, mask=mask, implementation="auto", backend="gpu", **kw
        )
        with paths.recording() as rec:
            jax.jit(f).trace(q, k, v)
        return [s.path for s in rec.steps]

    # Every case not measured with cuDNN takes the Pallas GPU kernel (a GPU program: on this
    # CPU host it is traced, not run).
    assert path(q=q.astype(jnp.float32), k=k.astype(jnp.float32), v=v.astype(jnp.float32)) == [
        "pallas_gpu"
    ]
    assert path(k=k[:, :, :1], v=v[:, :, :1]) == ["pallas_gpu"]  # grouped keys: not measured
    assert path(mask=masks.MaskSpec.for_sequence(T64, causal=True, window=8)) == ["pallas_gpu"]
    short = masks.MaskSpec.for_sequence(48, causal=True)
    # 48 queries: the block is the whole length, not a power of two Triton tiles: XLA's path
    assert path(q=q[:, :48], k=k[:, :48], v=v[:, :48], mask=short) == ["xla"]
    assert path(softcap=30.0) == ["pallas_gpu"]
    monkeypatch.setattr(dense_attention, "_nvidia_gpu", lambda: False)  # a GPU of another make
    assert path() == ["pallas_gpu"]
