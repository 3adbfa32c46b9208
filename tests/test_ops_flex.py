"""``ops.flex_attention`` and the chunked path's score functions against float64 NumPy.

Values and gradients (of q, k, v, the sinks and every array the score function closes over)
are checked against ``reference.flex_attention``, an explicit loop over the formula, for
each mask kind, grouped heads and lengths that are not multiples of the blocks. Cases that
differ only in data share one compiled program (a ``MaskSpec`` with every field present,
neutral values where a case does not use it). The block mask's skipping is counted: the
score function and the mask evaluation report each call through ``jax.debug.callback``.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from attnlab.ops import (
    MaskSpec,
    chunked,
    chunked_backward,
    dot_product_attention,
    flex,
    flex_attention,
)
from attnlab.ops.block_mask import BlockMask

B, N, K, H = 2, 4, 2, 8
BLOCKS = dict(block_q=4, block_k=8)
TOL = dict(rtol=2e-5, atol=2e-5)


def _qkv(seed, T, S):
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))
    return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def _bias_alibi(bias_N, slopes_N):
    """A per-head bias and an ALiBi-like slope, both closed over (both get gradients)."""

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + bias_N[h] - slopes_N[h] * jnp.abs(q_idx - kv_idx).astype(jnp.float32)

    return score_mod


def _ref_score(bias_N, slopes_N):
    bias_N, slopes_N = np.asarray(bias_N, np.float64), np.asarray(slopes_N, np.float64)
    return lambda s, b, n, t, j: s + bias_N[n] - slopes_N[n] * abs(t - j)


def _ref_param_grads(ds2_BNTS):
    """d bias_n = sum ds2[:, n]; d slope_n = -sum ds2[:, n] |t - j| (the score's chain rule)."""
    T, S = ds2_BNTS.shape[2:]
    dist_TS = np.abs(np.arange(T)[:, None] - np.arange(S)[None, :])
    return ds2_BNTS.sum((0, 2, 3)), -(ds2_BNTS * dist_TS).sum((0, 2, 3))


def _loss_and_grads(*, softcap=None, with_sinks=True, implementation="chunked"):
    """One jitted value-and-gradient over (q, k, v, dout, bias, slopes, sinks, mask)."""

    def loss(q, k, v, dout, bias_N, slopes_N, sinks_N, mask):
        out = flex_attention(
            q, k, v, score_mod=_bias_alibi(bias_N, slopes_N), mask=mask, softcap=softcap,
            sinks=sinks_N if with_sinks else None, implementation=implementation, **BLOCKS,
        )  # fmt: skip
        return jnp.sum(out * dout), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4, 5, 6), has_aux=True))


def _spec(T, S, *, causal, window=None, seg=None, k_length=None, k_valid=None, q_valid=None,
          prefix=None):  # fmt: skip
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    seg = np.ones((B, T), np.int32) if seg is None else np.asarray(seg, np.int32)
    return MaskSpec(
        q_pos=i32(np.arange(T)[None]),
        k_pos=i32(np.arange(S)[None]),
        causal=causal,
        window=None if window is None else i32(window),
        q_segment=i32(seg),
        k_segment=i32(seg),
        k_length=i32([S, S] if k_length is None else k_length),
        k_valid=jnp.asarray(np.ones((B, S), bool) if k_valid is None else k_valid),
        q_valid=jnp.asarray(np.ones((B, T), bool) if q_valid is None else q_valid),
        prefix_length=i32([0, 0] if prefix is None else prefix),
    )


def _np_mask(T, S, *, causal, window=None, seg=None, k_length=None, k_valid=None,
             q_valid=None, prefix=None):  # fmt: skip
    """The same mask from its definitions, in NumPy: [B, 1, T, S]."""
    t, s = np.arange(T)[None, :, None], np.arange(S)[None, None, :]
    ok = np.ones((B, T, S), bool)
    if causal:
        ok &= (s <= t) | (s < np.asarray([0, 0] if prefix is None else prefix)[:, None, None])
    if window is not None:
        ok &= (s <= t) & (s > t - window)
    if seg is not None:
        ok &= (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    if k_length is not None:
        ok &= s < np.asarray(k_length)[:, None, None]
    if k_valid is not None:
        ok &= k_valid[:, None, :]
    if q_valid is not None:
        ok &= np.broadcast_to(q_valid, (B, T))[:, :, None]
    return ok[:, None]


T = 11  # not a multiple of block_q = 4 nor of block_k = 8
SEG = np.array([[1] * 5 + [2] * 6, [3] * 3 + [0] * 2 + [4] * 6])  # packed, row 1 with padding
KV = np.ones((B, T), bool)
KV[1, 2:9] = False
CAUSAL_CASES = {
    "causal": {},
    "documents": dict(seg=SEG),  # row 1's padding queries (segment 0) are fully masked
    "prefix_lm": dict(prefix=[4, 7]),
    "ragged_k_length": dict(k_length=[6, 11]),
    "k_valid_and_masked_rows": dict(k_valid=KV, q_valid=np.arange(T)[None] % 3 != 1),
}


def _check(got, want_out, want, params):
    (value, out), grads = got
    np.testing.assert_allclose(np.asarray(out), want_out, **TOL)
    for name, g in zip(("q", "k", "v"), grads[:3], strict=True):
        np.testing.assert_allclose(np.asarray(g), want[name], **TOL, err_msg=name)
        assert np.isfinite(np.asarray(g)).all()
    d_bias, d_slopes = _ref_param_grads(want["ds2"])
    np.testing.assert_allclose(np.asarray(grads[3]), d_bias, **TOL, err_msg="bias_N")
    np.testing.assert_allclose(np.asarray(grads[4]), d_slopes, **TOL, err_msg="slopes_N")
    if params.get("sinks", True):
        np.testing.assert_allclose(np.asarray(grads[5]), want["sinks"], **TOL, err_msg="sinks")


def _params(seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(N), jnp.float32),
            jnp.asarray(rng.uniform(0.1, 0.5, N), jnp.float32),
            jnp.asarray(rng.standard_normal(N), jnp.float32))  # fmt: skip


def test_every_causal_mask_kind_equals_float64_values_and_gradients():
    """Causal, packed documents, prefix-LM, ragged lengths and fully masked rows, with
    softcap, sinks and a score function closing over two per-head arrays, GQA."""
    _check_cases(CAUSAL_CASES)


@pytest.mark.slow(reason="a second compiled program (a window is a field of its own)")
def test_sliding_windows_equal_float64_values_and_gradients():
    _check_cases({f"window {w}": dict(window=w, seg=SEG) for w in (1, 3, 8)})


def _check_cases(cases):
    fn = _loss_and_grads(softcap=4.0)
    q, k, v, dout = _qkv(0, T, T)
    bias_N, slopes_N, sinks_N = _params(1)
    for name, fields in cases.items():
        spec = _spec(T, T, causal=True, **fields)
        got = fn(q, k, v, dout, bias_N, slopes_N, sinks_N, spec)
        want_out, want = ref.flex_attention(
            q, k, v, dout, score=_ref_score(bias_N, slopes_N), softcap=4.0, sinks_N=sinks_N,
            mask=_np_mask(T, T, causal=True, **fields),
        )  # fmt: skip
        try:
            _check(got, want_out, want, {})
        except AssertionError as e:
            raise AssertionError(f"mask kind {name}: {e}") from None
    if "documents" not in cases:
        return
    masked = ~_np_mask(T, T, causal=True, seg=SEG).any(-1)  # [B, 1, T]
    assert masked.any()  # the documents case has fully masked rows: zero output there
    out = np.asarray(fn(q, k, v, dout, bias_N, slopes_N, sinks_N, _spec(T, T, causal=True,
                        seg=SEG))[0][1])  # fmt: skip
    assert (out[np.transpose(masked, (0, 2, 1))[..., 0]] == 0).all()


@pytest.mark.slow(reason="a compiled program of its own (no mask: every block full)")
def test_no_mask_and_cross_lengths_equal_float64():
    """mask=None over 7 queries and 13 keys (every visited block full but the padded one)."""
    fn = _loss_and_grads(with_sinks=False)
    q, k, v, dout = _qkv(2, 7, 13)
    bias_N, slopes_N, sinks_N = _params(3)
    got = fn(q, k, v, dout, bias_N, slopes_N, sinks_N, None)
    want_out, want = ref.flex_attention(q, k, v, dout, score=_ref_score(bias_N, slopes_N))
    _check(got, want_out, want, {"sinks": False})


def _counting(monkeypatch):
    """Counters of score-function calls and mask evaluations, as they run."""
    calls = {"score": 0, "mask": 0}

    def bump(name):
        calls[name] += 1

    original = chunked.mask_block

    def mask_block(*args):
        jax.debug.callback(lambda: bump("mask"))
        return original(*args)

    for passes in (chunked, chunked_backward):  # the forward pass and the backward one
        monkeypatch.setattr(passes, "mask_block", mask_block)

    def score_mod(s, b, h, q_idx, kv_idx):
        jax.debug.callback(lambda: bump("score"))
        return s

    return calls, score_mod


def test_empty_blocks_are_skipped_and_full_blocks_evaluate_no_mask(monkeypatch):
    """Causal over 16 x 16 in 4 x 4 blocks: of 16 block pairs, 6 are empty (never visited),
    6 full (visited, no mask evaluated) and 4 on the diagonal partial, in each pass."""
    calls, score_mod = _counting(monkeypatch)
    q, k, v, _ = _qkv(4, 16, 16)
    spec = MaskSpec.for_sequence(16, causal=True)
    dense = np.tril(np.ones((16, 16), bool)).reshape(4, 4, 4, 4)  # [qb, t, kb, s]
    any_QK, all_QK = dense.any((1, 3)), dense.all((1, 3))
    visited, partial = int(any_QK.sum()), int((any_QK & ~all_QK).sum())
    assert (visited, partial) == (10, 4)

    def loss(q, k, v):
        out = flex_attention(q, k, v, score_mod=score_mod, mask=spec, implementation="chunked",
                             block_q=4, block_k=4)  # fmt: skip
        return out.sum()

    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    assert calls == {"score": 2 * visited, "mask": 2 * partial}  # forward and backward
    counts = BlockMask.from_spec(spec, 16, 16, block_q=4, block_k=4).counts()
    assert counts == {"empty": 16 - visited, "partial": partial, "full": visited - partial}


@pytest.mark.parametrize(
    "T_new", [1, pytest.param(3, marks=pytest.mark.slow(reason="the chunked path compiled"))]
)
def test_queries_after_a_cache_see_their_cache_positions(T_new):
    """A decoding step (one query; the one-query path) and a prefill continuing a cache (3
    queries; the chunked path), per row at cache positions 5 and 8 of 12 slots: the score
    function sees q_idx = the query's position, as the variant trained."""
    q, k, v, _ = _qkv(5, T_new, 12)
    bias_N, slopes_N, _ = _params(6)
    start_B = np.array([5, 8])
    mask = MaskSpec.for_cache(T_new, 12, start_B)
    impl = "auto" if T_new == 1 else "chunked"
    out = dot_product_attention(q, k, v, mask=mask, score_mod=_bias_alibi(bias_N, slopes_N),
                                implementation=impl, backend="cpu")  # fmt: skip
    score = _ref_score(bias_N, slopes_N)
    for b in range(B):
        row, p = slice(b, b + 1), int(start_B[b])
        allowed = np.arange(12)[None, :] <= p + np.arange(T_new)[:, None]
        want = ref.flex_attention(
            q[row], k[row], v[row], mask=allowed[None, None],
            score=lambda s, _b, n, t, j, p=p: score(s, 0, n, p + t, j),
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(out[row]), want, **TOL)


# Bad input: one line naming the argument ---------------------------------------------------


@pytest.mark.parametrize(
    "score_mod, match",
    [
        (lambda s, b, h, q: s, r"score_mod must take five positional arguments"),
        (lambda s, b, h, q, k: jnp.sum(s), r"score_mod must return an array of the score's shape"),
        (lambda s, b, h, q, k: s[..., :1], r"score_mod must return an array of the score's shape"),
        (lambda s, b, h, q, k: (s > 0).astype(jnp.int32), r"score_mod must return float"),
        ("not callable", r"score_mod must be a callable"),
    ],
)
def test_a_bad_score_mod_is_named(score_mod, match):
    q, k, v, _ = _qkv(7, 5, 5)
    for implementation in ("chunked", "reference"):
        with pytest.raises(ValueError, match=match) as e:
            flex_attention(q, k, v, score_mod=score_mod, implementation=implementation)
        assert "\n" not in str(e.value)


def test_bad_blocks_masks_and_block_masks_are_named():
    q, k, v, _ = _qkv(8, 5, 5)
    with pytest.raises(ValueError, match=r"block_q=0 must be a positive integer"):
        flex_attention(q, k, v, implementation="chunked", block_q=0)
    with pytest.raises(ValueError, match=r"block_k=2.5 must be a positive integer"):
        flex_attention(q, k, v, implementation="chunked", block_k=2.5)
    with pytest.raises(ValueError, match=r"mask must be None, a MaskSpec or a boolean array"):
        flex_attention(q, k, v, mask=np.ones((5, 5), bool))
    with pytest.raises(ValueError, match=r"mask: a MaskSpec over \(T, S\)=\(6, 6\)"):
        flex_attention(q, k, v, mask=MaskSpec.for_sequence(6))
    other = BlockMask.from_spec(None, 5, 5, block_q=2, block_k=2)
    with pytest.raises(ValueError, match=r"block_mask: built for blocks \(2, 2\)"):
        flex_attention(q, k, v, block_mask=other, implementation="chunked", block_q=4)
    with pytest.raises(ValueError, match=r"implementation='fast' is unknown"):
        flex_attention(q, k, v, implementation="fast")
    with pytest.raises(ValueError, match=r"logits_fn .* pass an elementwise score_mod"):
        dot_product_attention(q, k, v, implementation="chunked", logits_fn=lambda s: s)


def test_a_missing_kernel_falls_back_to_chunked_and_says_so(caplog, monkeypatch):
    """A kernel that is not installed (here: a module path that cannot import) is named in
    one log line, with the path that runs instead."""
    from attnlab.ops import flex

    monkeypatch.setitem(flex.KERNELS, "pallas_gpu", ("attnlab.ops.no_such_kernel", "fn"))
    q, k, v, _ = _qkv(9, 5, 5)
    with caplog.at_level(logging.INFO, logger="attnlab.attention"):
        monkeypatch.setattr(flex.paths, "_SAID", set())
        out = flex_attention(q, k, v, implementation="pallas_gpu", interpret=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "attnlab.attention"]
    assert lines == [
        "implementation='pallas_gpu': attnlab.ops.no_such_kernel is not installed; falling "
        "back to the next path ('chunked')"
    ]
    want, _ = ref.attention(q, k, v)
    np.testing.assert_allclose(np.asarray(out), want, **TOL)


def test_a_kernel_that_cannot_express_a_call_falls_back_with_its_reason(caplog, monkeypatch):
    """``supports`` returning a reason (the kernel cannot take this mask) is logged, and the
    chunked path runs."""
    import sys
    import types

    from attnlab.ops import flex

    module = types.ModuleType("fake_kernel")
    module.supports = lambda *a, mask=None, **kw: (
        "mask: a dense mask array is not expressible by this kernel" if mask is not None
        else None
    )  # fmt: skip
    module.fn = lambda q, k, v, **kw: pytest.fail("the kernel must not run")
    monkeypatch.setitem(sys.modules, "fake_kernel", module)
    monkeypatch.setitem(flex.KERNELS, "pallas_tpu", ("fake_kernel", "fn"))
    monkeypatch.setattr(flex.paths, "_SAID", set())
    q, k, v, _ = _qkv(10, 5, 5)
    mask = np.tril(np.ones((5, 5), bool))[None, None]
    with caplog.at_level(logging.INFO, logger="attnlab.attention"):
        out = flex_attention(q, k, v, mask=mask, implementation="pallas_tpu")
    assert [r.getMessage() for r in caplog.records] == [
        "mask: a dense mask array is not expressible by this kernel; falling back to the "
        "next path ('chunked')"
    ]
    want, _ = ref.attention(q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(out), want, **TOL)


def _fake_kernel(monkeypatch, name, calls):
    """Kernel ``name`` as a module that records its calls and computes the float32
    reference (``flex.reference_flex``) of what it is given."""
    import sys
    import types

    from attnlab.ops import flex

    module = types.ModuleType(f"fake_{name}")
    module.supports = lambda *a, **kw: None

    def fn(q, k, v, *, score_mod, mask, scale, sinks, softcap, q_offset=None, **kw):
        calls.append(score_mod)
        return flex.reference_flex(q, k, v, score_mod=score_mod, mask=mask, scale=scale,
                                   sinks=sinks, softcap=softcap, q_offset=q_offset)  # fmt: skip

    module.fn = fn
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(flex.KERNELS, name, (module.__name__, "fn"))


@pytest.mark.slow(reason="two dense biased reference runs through a stand-in kernel")
def test_position_biases_reach_a_gpu_kernel_as_score_functions(monkeypatch):
    """On a GPU, ALiBi and T5's buckets (``PositionBias``) reach the fused kernel as score
    functions closing over their parameters, equal to the float64 biased attention."""
    from attnlab.ops import PositionBias

    calls = []
    _fake_kernel(monkeypatch, "pallas_gpu", calls)
    q, k, v, _ = _qkv(11, 9, 9)
    pos = jnp.arange(9, dtype=jnp.int32)[None]
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    table = jnp.asarray(np.random.default_rng(12).standard_normal((8, N)), jnp.float32)
    rel = np.arange(9)[None, :] - np.arange(9)[:, None]  # k - q
    buckets = ref.relative_position_bucket(rel, bidirectional=True, num_buckets=8, max_distance=16)
    biases = {
        "alibi": (PositionBias.alibi(slopes, pos, pos), ref.alibi_bias(slopes, pos, pos)),
        "relative": (
            PositionBias.relative(table, pos, pos, bidirectional=True, max_distance=16),
            np.transpose(np.asarray(table, np.float64)[buckets], (2, 0, 1))[None],
        ),
    }
    mask = MaskSpec.for_sequence(9, causal=True)
    for name, (bias, want_bias) in biases.items():
        out = dot_product_attention(q, k, v, mask=mask, bias=bias, implementation="auto",
                                    backend="gpu")  # fmt: skip
        want, _ = ref.attention(q, k, v, mask=np.tril(np.ones((9, 9), bool)), bias=want_bias)
        np.testing.assert_allclose(np.asarray(out), want, **TOL, err_msg=name)
    assert len(calls) == 2 and all(callable(c) for c in calls)


@pytest.mark.slow(reason="builds a model and runs it on two paths")
def test_a_registered_score_function_runs_the_chunked_path_in_a_model(monkeypatch):
    """A score function registered from a notebook (``register_attention``) reaches the
    chunked path through ``dot_product_attention(score_mod=...)`` under "auto" on a CPU,
    and the model's logits equal the reference path's."""
    from attnlab import ModelConfig, build_model
    from attnlab.contracts import score_function as variants
    from attnlab.ops import flex

    seen = []
    original = flex.chunked_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("score_mod"))
        return original(*args, **kwargs)

    monkeypatch.setattr(flex, "chunked_attention", spy)

    def capped(q, k, v, **kw):
        mod = lambda s, b, h, q_idx, kv_idx: 2.0 * jnp.tanh(s / 2.0)  # noqa: E731
        return dot_product_attention(q, k, v, score_mod=mod, **kw)

    monkeypatch.setitem(variants._REGISTRY, "capped_flex_test", capped)
    ids = jnp.asarray(np.random.default_rng(13).integers(1, 50, (2, 12)), jnp.int32)
    logits = {}
    for impl in ("auto", "reference"):
        cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=16,
                          attention_fn="capped_flex_test", attention_impl=impl)  # fmt: skip
        logits[impl] = np.asarray(build_model(cfg, seed=0)(ids).logits)
    assert seen and all(callable(m) for m in seen)
    np.testing.assert_allclose(logits["auto"], logits["reference"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow(reason="a stand-in decode kernel's reference run")
def test_a_gpu_decoding_step_runs_the_decode_kernel_with_the_cache_position(monkeypatch):
    """On a GPU, a one-query call goes to ``pallas.decode.flex_decode_gpu``; a kernel that
    takes no ``q_offset`` gets a score function that adds the cache position to q_idx."""
    import sys
    import types

    from attnlab.ops import flex

    calls = []
    module = types.ModuleType("fake_decode")
    module.supports = lambda *a, **kw: None

    def decode(q, k, v, *, score_mod, mask, scale, sinks, softcap, block_k, num_splits,
               interpret):  # fmt: skip
        calls.append(num_splits)
        return flex.reference_flex(q, k, v, score_mod=score_mod, mask=mask, scale=scale,
                                   sinks=sinks, softcap=softcap)  # fmt: skip

    module.decode = decode
    monkeypatch.setitem(sys.modules, "fake_decode", module)
    monkeypatch.setattr(flex, "DECODE_KERNEL", ("fake_decode", "decode"))
    q, k, v, _ = _qkv(14, 1, 12)
    bias_N, slopes_N, _ = _params(15)
    start_B = np.array([5, 8])
    out = dot_product_attention(q, k, v, mask=MaskSpec.for_cache(1, 12, start_B),
                                score_mod=_bias_alibi(bias_N, slopes_N), implementation="auto",
                                backend="gpu")  # fmt: skip
    assert calls == [None]
    score = _ref_score(bias_N, slopes_N)
    for b in range(B):
        row, p = slice(b, b + 1), int(start_B[b])
        at_p = lambda s, _b, n, t, j, p=p: score(s, 0, n, p, j)  # noqa: E731
        want = ref.flex_attention(q[row], k[row], v[row], mask=np.arange(12) <= p, score=at_p)
        np.testing.assert_allclose(np.asarray(out[row]), want, **TOL)


def test_verbose_prints_each_fallback_once(monkeypatch):
    """``log_fallbacks`` (what ``attnlab train --verbose`` turns on) prints each distinct
    fallback line once, prefixed ``attention:``."""
    import io

    from attnlab.ops import flex

    monkeypatch.setattr(flex.paths, "_SAID", set())
    stream = io.StringIO()
    before = list(flex.LOGGER.handlers), flex.LOGGER.level
    try:
        monkeypatch.setattr(flex.LOGGER, "handlers", [])
        flex.log_fallbacks(stream)
        for _ in range(2):
            flex.say("mask: not expressible; falling back to the next path ('chunked')")
    finally:
        flex.LOGGER.handlers[:] = before[0]
        flex.LOGGER.setLevel(before[1])
    assert stream.getvalue() == (
        "attention: mask: not expressible; falling back to the next path ('chunked')\n"
    )


@pytest.mark.parametrize(
    "implementation", ["reference", "chunked", "pallas_gpu", "pallas_tpu", "auto"]
)
def test_a_direct_call_with_a_cache_spec_gives_the_score_function_positions(implementation):
    """``flex_attention`` called directly with ``MaskSpec.for_cache`` (queries continuing a
    cache): ``q_idx`` and ``kv_idx`` are the tokens' positions on every path, the decode
    kernel's included, checked against ``jax.nn.dot_product_attention`` with the same
    distance bias built from explicit positions."""
    rng = np.random.default_rng(3)
    B, T, S, N, K, H = 2, 2, 24, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    start = jnp.array([5, 17])
    mod = lambda s, b, h, q_idx, kv_idx: s - 0.3 * (q_idx - kv_idx).astype(jnp.float32)
    spec = MaskSpec.for_cache(T, S, start)
    for Tq in (T, 1):  # a prefill chunk of two queries, and a decoding step (decode kernel)
        spec = MaskSpec.for_cache(Tq, S, start)
        with flex.paths.recording() as rec:
            out = flex_attention(q[:, :Tq], k, v, mask=spec, score_mod=mod, backend="gpu",
                                 implementation=implementation, interpret=True, block_q=8,
                                 block_k=8)  # fmt: skip
        if implementation == "auto":  # the GPU's kernels: flex for two queries, decode for one
            assert [s.path for s in rec.steps] == ["pallas_gpu" if Tq > 1 else "decode"]
        qp = np.asarray(start)[:, None] + np.arange(Tq)  # [B, Tq]
        bias = -0.3 * (qp[:, None, :, None] - np.arange(S)[None, None, None, :])
        allowed = np.arange(S)[None, None, None, :] <= qp[:, None, :, None]
        expected = jax.nn.dot_product_attention(
            q[:, :Tq], jnp.repeat(k, N // K, 2), jnp.repeat(v, N // K, 2),
            bias=jnp.asarray(bias, jnp.float32), mask=jnp.asarray(allowed),
        )  # fmt: skip
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("implementation", ["chunked", "pallas_gpu", "pallas_tpu"])
def test_a_spec_with_an_allowed_choice_is_obeyed_on_every_path(implementation):
    """``MaskSpec.allowed`` (a sparse mixer's choice of keys) reaches every path as the
    dense mask it stands for, never dropped."""
    rng = np.random.default_rng(5)
    B, T, N, H = 1, 16, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))
    allowed = jnp.asarray((rng.uniform(size=(B, 1, T, T)) < 0.5) | np.eye(T, dtype=bool))
    spec = MaskSpec.for_sequence(T, causal=True).replace(allowed=allowed, aligned=True)
    out = flex_attention(q, k, v, mask=spec, implementation=implementation, interpret=True,
                         block_q=8, block_k=8)  # fmt: skip
    dense = np.tril(np.ones((T, T), bool))[None, None] & np.asarray(allowed)
    expected = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(dense))
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
