"""The Pallas decode kernel (one query row per batch row against its cache, split over the
cache length) in interpret mode against float64 NumPy: cache lengths, a window, an
ALiBi-like score_mod at the query's cache position, softcap, sinks, grouped heads."""

import flex_reference as ref
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.errors import ConfigError
from attnlab.ops import score_mods
from attnlab.ops.masks import MaskSpec
from attnlab.ops.pallas import decode

F32 = jnp.float32


def _inputs(B=2, S=37, N=4, K=2, H=8, seed=0):
    r = np.random.default_rng(seed)
    q, k, v = (r.normal(size=s) for s in ((B, 1, N, H), (B, S, K, H), (B, S, K, H)))
    return tuple(jnp.asarray(x, F32) for x in (q, k, v))


def _mask_BNTS(start_B, S, window=None):
    """Row b's query at cache position start_B[b] sees keys s <= start (and > start - window)."""
    s = np.arange(S)[None, :]
    p = np.asarray(start_B)[:, None]
    m = s <= p
    if window is not None:
        m &= s > p - window
    return m[:, None, None, :]


def _check(q, k, v, start_B, *, window=None, slopes=None, softcap=None, sinks=None, **kw):
    S = k.shape[1]
    spec = MaskSpec.for_cache(1, S, start_B, window=window)
    score_mod = np_mod = None
    if slopes is not None:

        def score_mod(s, b, h, q_idx, kv_idx):
            return s + slopes[h] * (kv_idx - q_idx).astype(F32)

        def np_mod(s1):
            rel = np.arange(S)[None, None, None, :] - np.asarray(start_B)[:, None, None, None]
            return s1 + np.asarray(slopes, np.float64)[None, :, None, None] * rel, 1.0

    out = decode.flex_decode_gpu(q, k, v, score_mod=score_mod, mask=spec, softcap=softcap,
                                 sinks=sinks, interpret=True, **kw)  # fmt: skip
    want = ref.flex(q, k, v, np.zeros(q.shape), mask=_mask_BNTS(start_B, S, window), mod=np_mod,
                    softcap=softcap, sinks=sinks)["out"]  # fmt: skip
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow(reason="interpret-mode Pallas decode with every feature: ~2 s")
def test_decode_matches_float64():
    """Ragged cache lengths over 3 splits of 8-key blocks (37 keys: padded; row 0's later
    splits are past its cache, so empty), a window, an ALiBi-like closure at the query's
    cache position, softcap and sinks, grouped heads."""
    q, k, v = _inputs()
    slopes, sinks = jnp.asarray([0.1, 0.2, 0.3, 0.4], F32), jnp.asarray([0.5, -1, 0, 2], F32)
    _check(q, k, v, np.array([5, 30]), window=9, slopes=slopes, softcap=3.0, sinks=sinks,
           block_k=8, num_splits=3)  # fmt: skip


def test_decode_refusals_name_the_argument():
    q, k, v = _inputs()
    assert decode.supports(q, k, v, block_k=24).startswith("block_k=24")
    assert decode.supports(jnp.concatenate([q, q], 1), k, v).startswith("q_B1NH")
    assert decode.supports(q, k, v).startswith("q_B1NH: head dim H=8")
    assert decode.supports(q, k, v, interpret=True) is None
    # Whatever the host: the kernel is built for the GPU. Closed-over arrays indexed per
    # entry are ref loads, which Triton lowers; a gather of whole rows is not.
    q, k, v = _inputs(H=16)
    slopes, rows = jnp.ones(4, F32), jnp.ones((64, 3), F32)
    alibi = lambda s, b, h, i, j: s + slopes[h] * (j - i).astype(F32)
    gate = score_mods.forget_gate(jnp.ones((2, 4, 37), F32))
    for mod in (None, alibi, gate):
        assert decode.supports(q, k, v, score_mod=mod) is None
    rel_rows = lambda s, b, h, i, j: s + rows[j - i + 40].sum(-1)
    reason = decode.supports(q, k, v, score_mod=rel_rows)
    assert reason.startswith("score_mod: uses gather") and "\n" not in reason, reason
    with pytest.raises(ConfigError, match=r"^num_splits=0"):
        decode.flex_decode_gpu(q, k, v, num_splits=0, interpret=True)


@pytest.mark.slow(reason="interpret-mode Pallas decode with a dense mask")
def test_decode_dense_mask_per_head_with_sinks():
    q, k, v = _inputs()
    r = np.random.default_rng(2)
    m = r.uniform(size=(2, 4, 1, 37)) < 0.5
    m[1, :, :, :] = False  # a row with no key: the sinks take all the weight, output zero
    sinks = jnp.ones(4, F32)
    out = decode.flex_decode_gpu(q, k, v, mask=jnp.asarray(m), sinks=sinks, block_k=8,
                                 num_splits=3, interpret=True)  # fmt: skip
    want = ref.flex(q, k, v, np.zeros(q.shape), mask=m, sinks=np.ones(4))["out"]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow(reason="interpret-mode Pallas decode with a FoX gate")
def test_decode_forget_gate_causal_grouped():
    """FoX's gate (``score_mods.forget_gate`` over ``[B, N, S]``, read at the query's cache
    position and every key) under a plain causal cache mask, 4 query heads per kv head
    (padded to 16 rows inside the kernel); row 0's query is at position 0: one key."""
    q, k, v = _inputs(N=8, K=2, seed=1)
    S, start = k.shape[1], np.array([0, 36])
    r = np.random.default_rng(4)
    gate = -np.cumsum(r.uniform(0.0, 0.3, (2, 8, S)), -1)
    out = decode.flex_decode_gpu(q, k, v, score_mod=score_mods.forget_gate(jnp.asarray(gate, F32)),
                                 mask=MaskSpec.for_cache(1, S, start), block_k=16,
                                 interpret=True)  # fmt: skip

    def np_mod(s1):
        at_q = gate[np.arange(2), :, start][:, :, None, None]
        return s1 + at_q - gate[:, :, None, :], 1.0

    want = ref.flex(q, k, v, np.zeros(q.shape), mask=_mask_BNTS(start, S), mod=np_mod)["out"]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow(reason="interpret-mode Pallas decode with a dense mask")
def test_decode_dense_mask_shared_fully_masked_row():
    """A dense ``[B, 1, 1, S]`` mask shared by the heads; row 1 allows no key and has no
    sinks: its output is zero."""
    q, k, v = _inputs()
    m = np.random.default_rng(5).uniform(size=(2, 1, 1, 37)) < 0.5
    m[1] = False
    out = decode.flex_decode_gpu(q, k, v, mask=jnp.asarray(m), block_k=16, num_splits=2,
                                 interpret=True)  # fmt: skip
    want = ref.flex(q, k, v, np.zeros(q.shape), mask=m)["out"]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5, rtol=2e-5)
    assert not np.asarray(out[1]).any()
