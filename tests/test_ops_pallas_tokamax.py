"""The Tokamax adapter: the calls it refuses (one line naming the argument) and, where
Tokamax is installed, its argument mapping checked against float64 through Tokamax's XLA
path on the CPU (its fused GPU kernels refuse a CPU, so they are unmeasured here)."""

import importlib.util

import flex_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.ops.masks import MaskSpec
from attnlab.ops.pallas import tokamax_gpu

F32 = jnp.float32


def _inputs(B=2, T=16, N=4, K=2, H=8):
    r = np.random.default_rng(0)
    shapes = ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))
    return tuple(jnp.asarray(r.normal(size=s), F32) for s in shapes)


def test_tokamax_refusals_name_the_argument():
    q, k, v, _ = _inputs()
    seg = np.ones((2, 16), int)
    for kw, start in (
        (dict(score_mod=lambda s, b, h, i, j: s), "score_mod"),
        (dict(sinks=jnp.zeros(4)), "sinks"),
        (dict(mask=MaskSpec.for_sequence(16, causal=True, segment_ids=seg)), "mask.q_segment"),
        (dict(mask=MaskSpec.for_sequence(16, causal=True, offset=3)), "mask: Tokamax's causal"),
    ):
        reason = tokamax_gpu.supports(q, k, v, **kw)
        assert reason.startswith(start) and reason.endswith("falling back to pallas_gpu"), reason
    if importlib.util.find_spec("tokamax") is None:
        assert tokamax_gpu.supports(q, k, v).startswith("tokamax: not installed")


@pytest.mark.slow(reason="imports Tokamax (~6 s) and differentiates its XLA path")
@pytest.mark.parametrize("kind", ["window_softcap", "ragged"])
def test_tokamax_mapping_matches_float64(kind):
    pytest.importorskip("tokamax", reason="Tokamax is optional: pip install 'attnlab[tokamax]'")
    q, k, v, do = _inputs()
    B, T = q.shape[:2]
    if kind == "window_softcap":
        mask, ref_mask, softcap = MaskSpec.for_sequence(T, causal=True, window=5), None, 2.0
        ref_mask = ref.window(B, T, T, 5)
    else:
        lengths = np.array([9, 16])
        mask, softcap = MaskSpec.for_sequence(T, k_length=lengths), None
        ref_mask = ref.k_length(lengths, T, T)
    run = lambda q, k, v: tokamax_gpu.tokamax_attention(
        q, k, v, mask=mask, softcap=softcap, interpret=True, implementation="xla"
    )
    out, vjp = jax.vjp(run, q, k, v)
    want = ref.flex(q, k, v, do, mask=ref_mask, softcap=softcap)
    np.testing.assert_allclose(np.asarray(out, np.float64), want["out"], atol=2e-5, rtol=2e-5)
    for name, got in zip(("dq", "dk", "dv"), vjp(do), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), want[name], atol=2e-5,
                                   rtol=2e-5, err_msg=name)  # fmt: skip
