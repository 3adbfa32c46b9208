"""The streaming Mosaic-TPU flex kernels (``attnlab.ops.pallas.flex_tpu``) in Pallas interpret
mode on the CPU against float64 NumPy (``tests/flex_reference.py``): values and gradients of
q, k, v, the sinks and the float arrays a ``score_mod`` closes over, per mask kind, with
grouped heads (N=4, K=2) and T not a multiple of the block; block skipping; the one-line
refusals; and one lowering for a TPU from this host.
"""

import flex_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.errors import ConfigError
from attnlab.ops import score_mods
from attnlab.ops.block_mask import BlockMask
from attnlab.ops.masks import MaskSpec
from attnlab.ops.pallas import flex_tpu

F32 = jnp.float32
B, T, N, K, H = 2, 20, 4, 2, 8


def _inputs(T=T, S=None, seed=0):
    S = T if S is None else S
    r = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))
    return tuple(jnp.asarray(r.normal(size=s), F32) for s in shapes)


def _alibi(slopes_N):
    """``score_mods.alibi`` with learned slopes: ``s - slope_h |q - k|``."""

    def np_mod(s1):
        T_, S_ = s1.shape[-2:]
        dist = np.abs(np.arange(T_)[:, None] - np.arange(S_)[None, :])
        return s1 - np.asarray(slopes_N, np.float64)[None, :, None, None] * dist, 1.0

    def grads(r):
        T_, S_ = r["ds2"].shape[-2:]
        dist = np.abs(np.arange(T_)[:, None] - np.arange(S_)[None, :])
        return [-(r["ds2"] * dist).sum((0, 2, 3))]

    return score_mods.alibi(slopes_N), np_mod, grads


def _fox(cum_BNS):
    """``score_mods.forget_gate``: ``s + c[b, h, q] - c[b, h, k]``."""

    def np_mod(s1):
        c = np.asarray(cum_BNS, np.float64)
        return s1 + c[:, :, :, None] - c[:, :, None, :], 1.0

    def grads(r):
        return [r["ds2"].sum(3) - r["ds2"].sum(2)]

    return score_mods.forget_gate(cum_BNS), np_mod, grads


def _case(kind):
    r = np.random.default_rng(1)
    c = dict(inputs=_inputs())
    if kind == "none":
        pass
    elif kind == "causal":
        c.update(mask=MaskSpec.for_sequence(T, causal=True), ref_mask=ref.causal(B, T, T))
    elif kind == "window":
        c.update(mask=MaskSpec.for_sequence(T, causal=True, window=6),
                 ref_mask=ref.window(B, T, T, 6))  # fmt: skip
    elif kind == "prefix_lm":
        prefix = np.array([5, 11])
        c.update(mask=MaskSpec.for_sequence(T, causal=True, prefix_length=prefix),
                 ref_mask=ref.prefix_lm(prefix, T))  # fmt: skip
    elif kind == "packed":  # padding (segment 0) rows: fully masked, zero output and grads
        seg = np.array([[1] * 7 + [2] * 9 + [0] * 4, [1] * 3 + [2] * 3 + [3] * 14])
        c.update(mask=MaskSpec.for_sequence(T, causal=True, segment_ids=seg),
                 ref_mask=ref.segments(seg) & ref.causal(B, T, T))  # fmt: skip
    elif kind == "ragged":  # T != S; the first row has no key at all
        S, lengths = 27, np.array([0, 19])
        c.update(inputs=_inputs(S=S), mask=MaskSpec.for_sequence(T, S, k_length=lengths),
                 ref_mask=ref.k_length(lengths, T, S))  # fmt: skip
    elif kind == "dense":  # per head; one query row fully masked
        m = r.uniform(size=(B, N, T, T)) < 0.4
        m[:, :, 3] = False
        c.update(mask=jnp.asarray(m), ref_mask=m)
    elif kind == "gemma2":  # window + softcap + sinks
        c.update(mask=MaskSpec.for_sequence(T, causal=True, window=6),
                 ref_mask=ref.window(B, T, T, 6), softcap=2.0,
                 sinks=jnp.asarray(r.normal(size=N), F32))  # fmt: skip
    elif kind == "alibi":
        c.update(mask=MaskSpec.for_sequence(T, causal=True), ref_mask=ref.causal(B, T, T),
                 mod=_alibi, consts=(jnp.asarray(r.uniform(0.1, 0.5, N), F32),))  # fmt: skip
    elif kind == "fox":
        cum = -np.cumsum(r.uniform(0.0, 0.3, (B, N, T)), -1)
        c.update(mask=MaskSpec.for_sequence(T, causal=True), ref_mask=ref.causal(B, T, T),
                 mod=_fox, consts=(jnp.asarray(cum, F32),))  # fmt: skip
    else:
        raise ValueError(kind)
    return c


def _check(case, tol=2e-5, **kw):
    """Kernel ≡ float64 reference: the output and d q, k, v, sinks, the closed-over arrays."""
    q, k, v, do = case["inputs"]
    consts, make_mod, sinks = case.get("consts", ()), case.get("mod"), case.get("sinks")

    def run(q, k, v, sinks, consts):
        score_mod = None if make_mod is None else make_mod(*consts)[0]
        return flex_tpu.flex_attention_tpu(
            q, k, v, score_mod=score_mod, mask=case.get("mask"), sinks=sinks,
            softcap=case.get("softcap"), interpret=True, **kw,
        )  # fmt: skip

    want = ref.flex(q, k, v, do, mask=case.get("ref_mask"),
                    mod=None if make_mod is None else make_mod(*consts)[1],
                    softcap=case.get("softcap"), sinks=sinks)  # fmt: skip
    out, vjp = jax.vjp(run, q, k, v, sinks, consts)
    np.testing.assert_allclose(np.asarray(out, np.float64), want["out"], atol=tol, rtol=tol)
    dq, dk, dv, dsinks, dconsts = vjp(do)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want[name], atol=tol, rtol=tol,
                                   err_msg=name)  # fmt: skip
    if sinks is not None:
        np.testing.assert_allclose(np.asarray(dsinks), want["dsinks"], atol=tol, rtol=tol)
    for got, exp in zip(dconsts, [] if make_mod is None else make_mod(*consts)[2](want),
                        strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), exp, atol=tol, rtol=tol, err_msg="consts")
    return out, dq, dk, dv


_SLOW = pytest.mark.slow(reason="interpret-mode forward and backward, ~5 s per mask kind")
FAST = ["packed", "gemma2", "fox"]  # padding rows, window + softcap + sinks, a streamed gate
KINDS = FAST + [pytest.param(kind, marks=_SLOW) for kind in
                ("none", "causal", "window", "prefix_lm", "ragged", "dense", "alibi")]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_matches_float64(kind):
    """Blocks of 8 over T = 20 (padded to 24), grouped heads; fully masked rows (padding
    segments, an empty ragged row, a dense row) get zero output and zero gradients."""
    out, dq, _, _ = _check(_case(kind), block_q=8, block_k=8)
    if kind == "packed":  # the last 4 queries of row 0 are padding
        assert not np.asarray(out[0, 16:]).any() and not np.asarray(dq[0, 16:]).any()
    if kind == "ragged":
        assert not np.asarray(out[0]).any() and not np.asarray(dq[0]).any()


@pytest.mark.slow(reason="interpret mode at the default blocks (whole T and S) and decode")
def test_default_blocks_and_one_query():
    """Default blocks (capped at T and S) and a one-query decode against a ragged cache."""
    case = _case("fox")
    _check(case)
    q, k, v, do = _inputs(T=1, S=40)
    lengths = np.array([13, 40])
    _check(dict(inputs=(q, k, v, do), mask=MaskSpec.for_sequence(1, 40, k_length=lengths),
                ref_mask=ref.k_length(lengths, 1, 40)), block_k=16)  # fmt: skip


def _grids(jaxpr):
    """The grids of the Pallas calls in ``jaxpr``, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(tuple(eqn.params["grid_mapping"].grid))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                out += _grids(inner)
    return out


def test_window_inside_jit_visits_a_bounded_number_of_blocks():
    """A window mask built inside jit (its positions known while tracing): the grid walks
    the longest row's visited blocks (2 of 5 here: a window of 6 spans at most two blocks
    of 8), and values and gradients stay the reference's."""
    T_, w = 40, 6
    q, k, v, do = _inputs(T=T_)

    def run(q, k, v):
        mask = MaskSpec.for_sequence(T_, causal=True, window=w)
        return flex_tpu.flex_attention_tpu(q, k, v, mask=mask, block_q=8, block_k=8,
                                           interpret=True)  # fmt: skip

    assert _grids(jax.make_jaxpr(run)(q, k, v).jaxpr) == [(B, N, 5, 2)]
    want = ref.flex(q, k, v, do, mask=ref.window(B, T_, T_, w))
    out, vjp = jax.vjp(jax.jit(run), q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float64), want["out"], atol=2e-5)
    for name, got in zip(("dq", "dk", "dv"), vjp(do), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), want[name], atol=2e-5,
                                   err_msg=name)  # fmt: skip


def test_empty_blocks_are_never_visited():
    """A block mask that calls an attendable block EMPTY: the kernel skips it, so the output
    is the reference's with that block masked (forward and backward)."""
    q, k, v, do = _inputs(T=16)
    kinds = np.array([[2, 0], [0, 2]])  # block-diagonal: (0, 1) and (1, 0) skipped
    bm = BlockMask.from_kinds(kinds, block_q=8, block_k=8, T=16, S=16)
    diag = np.kron(np.eye(2, dtype=bool), np.ones((8, 8), bool))[None, None]
    _check(dict(inputs=(q, k, v, do), ref_mask=diag), block_mask=bm)


def test_supports_is_host_independent_and_names_the_argument():
    q, k, v, _ = _inputs(T=256)
    assert flex_tpu.supports(q, k, v) is None  # built for a TPU on any host
    reason = flex_tpu.supports(q, k, v, block_q=12)
    assert reason.startswith("block_q=12") and "\n" not in reason
    assert flex_tpu.supports(q, k, v, block_q=12, interpret=True) is None
    slopes, cum = jnp.ones(N, F32), jnp.zeros((B, N, 256), F32)
    for mod in (score_mods.alibi(slopes), score_mods.forget_gate(cum)):
        assert flex_tpu.supports(q, k, v, score_mod=mod) is None
    rows = jnp.ones((600, 3), F32)
    rel_rows = lambda s, b, h, i, j: s + rows[j - i + 300].sum(-1)
    reason = flex_tpu.supports(q, k, v, score_mod=rel_rows)
    assert reason.startswith("score_mod: reads a closed-over array") and "\n" not in reason
    assert flex_tpu.supports(q, k, v, score_mod=rel_rows, interpret=True) is None
    with pytest.raises(ConfigError, match=r"^block_k=100"):
        flex_tpu.flex_attention_tpu(q, k, v, block_k=100)


def test_rows_gather_runs_in_interpret_mode():
    """A score_mod gathering rows of a closed-over table (refused for the chip) still runs in
    interpret mode, with gradients for the table."""
    q, k, v, do = _inputs()
    table = jnp.asarray(np.random.default_rng(2).normal(size=(2 * T, 2)), F32)
    dist = np.arange(T)[None, :] - np.arange(T)[:, None] + T

    def run(q, table):
        mod = lambda s, b, h, i, j: s + table[j - i + T].sum(-1)
        return flex_tpu.flex_attention_tpu(q, k, v, score_mod=mod, block_q=8, block_k=8,
                                           interpret=True)  # fmt: skip

    t = np.asarray(table, np.float64).sum(-1)
    want = ref.flex(q, k, v, do, mod=lambda s1: (s1 + t[dist], 1.0))
    out, vjp = jax.vjp(run, q, table)
    np.testing.assert_allclose(np.asarray(out, np.float64), want["out"], atol=2e-5)
    dq, dtable = vjp(do)
    np.testing.assert_allclose(np.asarray(dq, np.float64), want["dq"], atol=2e-5)
    dt = np.zeros(2 * T)
    np.add.at(dt, dist, want["ds2"].sum((0, 1)))
    np.testing.assert_allclose(np.asarray(dtable), np.stack([dt, dt], -1), atol=2e-5)


def test_lowers_for_tpu_forward_and_backward():
    """Forward and gradient (q, k, v, sinks, a FoX gate) lower to Mosaic kernels on this host."""
    T_ = 256
    q = jax.ShapeDtypeStruct((1, T_, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T_, 2, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((8,), F32)
    cum = jax.ShapeDtypeStruct((1, 8, T_), F32)

    def loss(q, k, v, sinks, cum):
        out = flex_tpu.flex_attention_tpu(
            q, k, v, mask=MaskSpec.for_sequence(T_, causal=True, window=100), softcap=30.0,
            sinks=sinks, score_mod=score_mods.forget_gate(cum),
        )  # fmt: skip
        return out.astype(F32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    text = jax.jit(grad).trace(q, k, k, sinks, cum).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # forward, dQ, dK/dV
