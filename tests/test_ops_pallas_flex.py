"""The Pallas flex-attention kernels (``attnlab.ops.pallas``) in interpret mode on the CPU
against float64 NumPy (``tests/flex_reference.py``): values and gradients of q, k, v, the
sinks and every array a ``score_mod`` closes over, per mask kind; the block mask's visits;
the one-line refusals. Interpret mode is slow: the shapes are tiny, the sweep is slow-tier.
"""

import flex_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.errors import ConfigError
from attnlab.ops.block_mask import BlockMask
from attnlab.ops.masks import MaskSpec
from attnlab.ops.pallas import flex_gpu, flex_tpu

F32 = jnp.float32


def _inputs(B=2, T=20, S=None, N=4, K=2, H=8, dtype=jnp.float32, seed=0):
    S = T if S is None else S
    r = np.random.default_rng(seed)
    q, k, v = (r.normal(size=s) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    do = r.normal(size=(B, T, N, H))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, do))


def _alibi(slopes):
    """ALiBi-like: ``s + slope[h] (kv - q)``, closing over per-head slopes."""

    def jax_mod(s, b, h, q_idx, kv_idx):
        return s + slopes[h] * (kv_idx - q_idx).astype(F32)

    def np_mod(s1):
        T, S = s1.shape[-2:]
        rel = np.arange(S)[None, :] - np.arange(T)[:, None]
        return s1 + np.asarray(slopes, np.float64)[None, :, None, None] * rel, 1.0

    def grads(r):
        T, S = r["ds2"].shape[-2:]
        rel = np.arange(S)[None, :] - np.arange(T)[:, None]
        return [(r["ds2"] * rel).sum((0, 2, 3))]

    return jax_mod, np_mod, grads


def _fox(gate_BNT):
    """FoX-like: ``s + F[b, h, q] - F[b, h, kv]``, closing over a cumulative log-gate."""

    def jax_mod(s, b, h, q_idx, kv_idx):
        row = gate_BNT[b, h]
        return s + row[q_idx] - row[kv_idx]

    def np_mod(s1):
        F = np.asarray(gate_BNT, np.float64)
        return s1 + F[:, :, :, None] - F[:, :, None, :], 1.0

    def grads(r):
        return [r["ds2"].sum(3) - r["ds2"].sum(2)]

    return jax_mod, np_mod, grads


def _temperature(temp_N):
    """``s * temp[h]``: a score_mod whose derivative in the score is not one."""

    def jax_mod(s, b, h, q_idx, kv_idx):
        return s * temp_N[h]

    def np_mod(s1):
        t = np.asarray(temp_N, np.float64)[None, :, None, None]
        return s1 * t, np.broadcast_to(t, s1.shape)

    def grads(r):
        return [(r["ds2"] * r["s1"]).sum((0, 2, 3))]

    return jax_mod, np_mod, grads


def _check(kernel, case, *, grads=True, tol=None, **kw):
    """Kernel ≡ float64 reference: the output and (with ``grads``) d q, k, v, sinks, consts."""
    q, k, v, do = case["inputs"]
    consts = case.get("consts", ())
    make_mod = case.get("mod")
    sinks = case.get("sinks")
    tol = tol or (2e-5 if q.dtype == jnp.float32 else 3e-2)

    def run(q, k, v, sinks, consts):
        score_mod = None if make_mod is None else make_mod(*consts)[0]
        return kernel(q, k, v, score_mod=score_mod, mask=case.get("mask"), sinks=sinks,
                      softcap=case.get("softcap"), interpret=True, **kw)  # fmt: skip

    np_mod = None if make_mod is None else make_mod(*consts)[1]
    want = ref.flex(q, k, v, do, mask=case.get("ref_mask"), mod=np_mod,
                    softcap=case.get("softcap"), sinks=sinks)  # fmt: skip
    if not grads:
        out = run(q, k, v, sinks, consts)
        np.testing.assert_allclose(np.asarray(out, np.float64), want["out"], atol=tol, rtol=tol)
        return
    out, vjp = jax.vjp(run, q, k, v, sinks, consts)
    np.testing.assert_allclose(np.asarray(out, np.float64), want["out"], atol=tol, rtol=tol)
    dq, dk, dv, dsinks, dconsts = vjp(do.astype(out.dtype))
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.isfinite(np.asarray(got, np.float64)).all(), name
        np.testing.assert_allclose(np.asarray(got, np.float64), want[name], atol=tol, rtol=tol,
                                   err_msg=name)  # fmt: skip
    if sinks is not None:
        np.testing.assert_allclose(np.asarray(dsinks), want["dsinks"], atol=tol, rtol=tol)
    if consts:
        for got, exp in zip(dconsts, make_mod(*consts)[2](want), strict=True):
            np.testing.assert_allclose(np.asarray(got), exp, atol=tol, rtol=tol, err_msg="consts")


def _case(kind, B=2, T=20):
    """A mask kind with a feature riding along (each case checks several at once)."""
    r = np.random.default_rng(1)
    N = 4
    c = dict(inputs=_inputs(B=B, T=T))
    if kind == "none":
        pass
    elif kind == "causal_alibi":
        c.update(mask=MaskSpec.for_sequence(T, causal=True), ref_mask=ref.causal(B, T, T),
                 mod=_alibi, consts=(jnp.asarray(r.uniform(0.1, 0.5, N), F32),))  # fmt: skip
    elif kind == "window_softcap_sinks":
        c.update(mask=MaskSpec.for_sequence(T, causal=True, window=6),
                 ref_mask=ref.window(B, T, T, 6), softcap=2.0,
                 sinks=jnp.asarray(r.normal(size=N), F32))  # fmt: skip
    elif kind == "segments_fox":  # packed documents, padding (segment 0) rows fully masked
        seg = np.array([[1] * 7 + [2] * 9 + [0] * 4, [1] * 3 + [2] * 3 + [3] * 14])[:B, :T]
        gate = -np.cumsum(r.uniform(0.0, 0.3, (B, N, T)), -1)
        c.update(mask=MaskSpec.for_sequence(T, causal=True, segment_ids=seg),
                 ref_mask=ref.segments(seg) & ref.causal(B, T, T), mod=_fox,
                 consts=(jnp.asarray(gate, F32),))  # fmt: skip
    elif kind == "prefix_temperature":
        prefix = np.array([5, 11])[:B]
        c.update(mask=MaskSpec.for_sequence(T, causal=True, prefix_length=prefix),
                 ref_mask=ref.prefix_lm(prefix, T), mod=_temperature,
                 consts=(jnp.asarray(r.uniform(0.5, 2.0, N), F32),))  # fmt: skip
    elif kind == "ragged_cross":  # T != S, one row with no key at all
        S = 27
        lengths = np.array([0, 19])[:B]
        c.update(inputs=_inputs(B=B, T=T, S=S),
                 mask=MaskSpec.for_sequence(T, S, k_length=lengths),
                 ref_mask=ref.k_length(lengths, T, S))  # fmt: skip
    elif kind == "dense_sinks":  # a dense mask per head, some rows fully masked
        m = r.uniform(size=(B, N, T, T)) < 0.4
        m[:, :, 3] = False
        c.update(mask=jnp.asarray(m), ref_mask=m, sinks=jnp.asarray(r.normal(size=N), F32))
    elif kind == "dense_shared":  # one dense [1, 1, T, S] mask for every row and head
        S = 27
        m = r.uniform(size=(1, 1, T, S)) < 0.5
        m[..., 2, :] = False
        c.update(inputs=_inputs(B=B, T=T, S=S), mask=jnp.asarray(m), ref_mask=m, softcap=3.0)
    elif kind == "offset_valid_cross":  # queries at a per-row offset into 27 keys: causal,
        S = 27  # cache lengths, invalid keys and queries, cross segments (some rows empty)
        start = np.array([3, 7])[:B]
        k_valid = r.uniform(size=(B, S)) < 0.8
        q_valid = np.ones((B, T), bool)
        q_valid[0, 4] = False
        q_seg = np.array([[1] * 12 + [2] * 8, [1] * 5 + [0] * 3 + [2] * 12])[:B, :T]
        k_seg = np.array([[1] * 14 + [2] * 13, [1] * 10 + [2] * 17])[:B]
        p = start[:, None, None] + np.arange(T)[None, :, None]
        s = np.arange(S)[None, None, :]
        m = (s <= p) & (s < (start + T)[:, None, None]) & k_valid[:, None, :]
        m &= q_valid[:, :, None] & (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg > 0)[..., None]
        spec = MaskSpec.for_sequence(T, S, causal=True, offset=start, k_length=start + T,
                                     k_valid=k_valid, q_valid=q_valid, segment_ids=q_seg,
                                     k_segment_ids=k_seg)  # fmt: skip
        c.update(inputs=_inputs(B=B, T=T, S=S), mask=spec, ref_mask=m[:, None], mod=_alibi,
                 consts=(jnp.asarray(r.uniform(0.1, 0.5, N), F32),))  # fmt: skip
    else:
        raise ValueError(kind)
    return c


KINDS = ["causal_alibi", "window_softcap_sinks", "segments_fox", "prefix_temperature",
         "ragged_cross", "dense_sinks", "dense_shared", "offset_valid_cross"]  # fmt: skip


def test_forward_and_block_visits_match_float64():
    """One forward with grouped heads, a window, an ALiBi-like closure, a softcap and sinks,
    T not a multiple of the block; the visits per program are the block mask's rows and only
    PARTIAL blocks evaluate the mask."""
    T, bq, bk = 20, 8, 8
    case = _case("window_softcap_sinks", T=T)
    slopes = jnp.asarray([0.1, 0.2, 0.3, 0.4], F32)
    q, k, v, do = case["inputs"]
    out, counts = flex_gpu.visited_blocks(
        q, k, v, score_mod=_alibi(slopes)[0], mask=case["mask"], sinks=case["sinks"],
        softcap=case["softcap"], block_q=bq, block_k=bk, interpret=True,
    )  # fmt: skip
    want = ref.flex(q, k, v, do, mask=case["ref_mask"], mod=_alibi(slopes)[1],
                    softcap=case["softcap"], sinks=case["sinks"])  # fmt: skip
    np.testing.assert_allclose(np.asarray(out, np.float64), want["out"], atol=2e-5, rtol=2e-5)
    # window 6 over blocks of 8: query block i sees key blocks i-1 (partial) and i (partial)
    bm = BlockMask.from_spec(case["mask"], T, T, block_q=bq, block_k=bk)
    kinds = np.asarray(bm.kind_QK)
    visited = (kinds != 0).sum(1)
    partial = (kinds == 1).sum(1)
    assert visited.tolist() == [1, 2, 2]
    np.testing.assert_array_equal(np.asarray(counts)[..., 0], np.broadcast_to(visited, (2, 4, 3)))
    np.testing.assert_array_equal(np.asarray(counts)[..., 1], np.broadcast_to(partial, (2, 4, 3)))


def test_full_blocks_evaluate_no_mask():
    """A block mask that calls a block FULL makes the kernel ignore the mask there: the
    output equals the float64 reference with that block's entries allowed."""
    T = 16
    q, k, v, do = _inputs(B=1, T=T, N=2, K=2)
    dense = np.asarray(ref.causal(1, T, T))
    kinds = np.array([[1, 0], [2, 1]])  # call the (1, 0) block FULL: it is, under causal
    dense_holes = dense.copy()
    dense_holes[..., 8:, :8] = False  # ... but the dense mask given disallows it
    bm = BlockMask.from_kinds(kinds, block_q=8, block_k=8, T=T, S=T)
    out = flex_gpu.flex_attention_gpu(q, k, v, mask=jnp.asarray(dense_holes), block_mask=bm,
                                      block_q=8, block_k=8, interpret=True)  # fmt: skip
    want = ref.flex(q, k, v, do, mask=dense)["out"]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5)
    honest = ref.flex(q, k, v, do, mask=dense_holes)["out"]
    assert np.abs(want - honest).max() > 1e-2  # the test can tell the two apart


def test_refusals_name_the_argument():
    q, k, v, _ = _inputs(B=1, T=16, N=4, K=2)
    reason = flex_gpu.supports(q, k, v, block_q=24, interpret=False)
    assert reason.startswith("block_q=24") and "\n" not in reason
    assert flex_gpu.supports(q, k, v, block_q=24, interpret=True) is None
    assert flex_gpu.supports(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)).startswith(
        "k_BSKH"
    )
    assert flex_gpu.supports(q, k, v, sinks=jnp.zeros(3)).startswith("sinks")
    assert flex_gpu.supports(q, k, v, score_mod=lambda s, b: s).startswith("score_mod")
    # On a GPU: closed-over arrays indexed per entry (ALiBi, a FoX gate) become ref loads,
    # which Triton lowers; a gather of whole rows does not.
    # Whatever the host: with interpret=False the kernel is built for the GPU.
    alibi, fox = _alibi(jnp.ones(4, F32))[0], _fox(jnp.ones((1, 4, 16), F32))[0]
    q16, k16, v16, _ = _inputs(B=1, T=16, N=4, K=2, H=16)
    for mod in (None, alibi, fox):
        assert flex_gpu.supports(q16, k16, v16, score_mod=mod, block_q=16) is None
    assert flex_gpu.supports(q, k, v).startswith("q_BTNH: head dim H=8")
    thirds = lambda s, b, h, i, j: jnp.concatenate([s[:, :4], s[:, 4:8] * 2, s[:, 8:]], 1)
    reason = flex_gpu.supports(q16, k16, v16, score_mod=thirds)
    assert reason.startswith("score_mod: uses concatenate of more than two arrays"), reason
    rows = jnp.ones((33, 3), F32)
    rel_rows = lambda s, b, h, i, j: s + rows[j - i + 16].sum(-1)
    reason = flex_gpu.supports(q, k, v, score_mod=rel_rows, block_q=16, block_k=16)
    assert reason.startswith("score_mod: uses gather"), reason
    assert flex_gpu.supports(q, k, v, score_mod=rel_rows, interpret=True) is None
    with pytest.raises(ConfigError, match=r"^score_mod: must take five") as e:
        flex_gpu.flex_attention_gpu(q, k, v, score_mod=lambda s: s, interpret=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^score_mod: must return a float array"):
        flex_gpu.flex_attention_gpu(q, k, v, score_mod=lambda s, b, h, i, j: s.sum(),
                                    interpret=True)  # fmt: skip
    with pytest.raises(ConfigError, match=r"^block_k=0"):
        flex_gpu.flex_attention_gpu(q, k, v, block_k=0, interpret=True)
    with pytest.raises(ConfigError, match=r"^mask: a dense mask"):
        flex_gpu.flex_attention_gpu(q, k, v, mask=jnp.ones((16, 16), bool), interpret=True)


@pytest.mark.slow(reason="interpret-mode Pallas forward and backward per mask kind: ~5 s each")
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_kernel_matches_float64(kind):
    _check(flex_gpu.flex_attention_gpu, _case(kind), block_q=8, block_k=8)


@pytest.mark.slow(reason="interpret-mode Pallas forward and backward in bfloat16")
def test_gpu_kernel_bfloat16_no_mask():
    case = _case("none", B=1, T=20)
    case["inputs"] = tuple(x.astype(jnp.bfloat16) for x in case["inputs"])
    _check(flex_gpu.flex_attention_gpu, case, block_q=16, block_k=8)


@pytest.mark.slow(reason="interpret-mode Pallas forward and backward, Mosaic-TPU layout")
def test_tpu_kernel_matches_float64():
    _check(flex_tpu.flex_attention_tpu, _case("segments_fox"), block_q=8, block_k=8)


@pytest.mark.slow(reason="interpret-mode splash attention: its blocks are at least 128 keys")
def test_splash_matches_float64():
    """Splash attention with a window, packed documents (padding rows: zero output), a
    softcap, sinks and grouped heads, at its smallest block (T = 2 blocks of 128)."""
    T, N = 256, 4
    r = np.random.default_rng(3)
    seg = np.array([[1] * 100 + [2] * 120 + [0] * 36])
    case = dict(
        inputs=_inputs(B=1, T=T, N=N, K=2),
        mask=MaskSpec.for_sequence(T, causal=True, window=40, segment_ids=seg),
        ref_mask=ref.window(1, T, T, 40) & ref.segments(seg),
        softcap=2.0,
        sinks=jnp.asarray(r.normal(size=N), F32),
    )
    assert flex_tpu.supports_splash(*case["inputs"][:3], mask=case["mask"], interpret=True) is None
    _check(flex_tpu.splash_attention, case, tol=1e-4)


def test_splash_refusals_name_the_argument():
    q, k, v, _ = _inputs(B=1, T=256, N=4, K=2)
    spec = MaskSpec.for_sequence(256, causal=True, prefix_length=np.array([5]))
    for kw, start in (
        (dict(score_mod=lambda s, b, h, i, j: s), "score_mod"),
        (dict(mask=spec), "mask.prefix_length"),
        (dict(mask=jnp.ones((1, 1, 256, 256), bool)), "mask: splash attention takes a MaskSpec"),
        (dict(block_q=64), "block_q=64"),
    ):
        reason = flex_tpu.supports_splash(q, k, v, interpret=True, **kw)
        assert reason.startswith(start) and reason.endswith("falling back to pallas_tpu"), reason
    assert flex_tpu.supports_splash(q[:, :20], k[:, :20], v[:, :20], interpret=True).startswith(
        "block_q=20"
    )
