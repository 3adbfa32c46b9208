"""Score functions on the context-parallel paths: ring attention (zigzag and contiguous
layouts) and all-gather attention with a ``score_mod`` equal float64 NumPy
(``reference.flex_attention``) in values and gradients, to q, k, v and the float arrays the
function closes over; the function sees the tokens' true indices in either layout and the
global batch row and query head however the batch and the heads are split; float64 inputs
compute in float64; and a model whose mixer has a score function (FoX's forget gate,
``mha``'s logit cap) runs context-parallel with the values of one device.

The checks on a mesh run in the child process that ``test_context_parallel.py`` starts on
8 fake CPU devices, which runs this file too; in the parent they skip.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from attnlab import ModelConfig, ops
from attnlab.devices import sharding
from attnlab.ops import context_parallel as cp
from attnlab.ops import shard_scores

CHILD = os.environ.get("ATTNLAB_MESH_CHILD") == "1"
on_mesh = pytest.mark.skipif(
    not CHILD, reason="runs in the child process of test_context_parallel.py (8 CPU devices)"
)

B, T, N, H = 2, 32, 8, 8
SHIFT_N = np.array([0, 1, -2, 3, 0, -1, 2, 5], np.int32)  # an integer per query head
ORDER_T = np.random.default_rng(7).permutation(T).astype(np.int32)  # an integer per token


# Each takes the array module and the arrays it closes over (jnp arrays in the parallel
# call, NumPy in the reference's scalar loop) and returns the score function.
SCORES = {
    "distance": lambda xp, a: lambda s, b, h, q, k: s - 0.3 * (q - k),
    "key": lambda xp, a: lambda s, b, h, q, k: s + xp.sin(0.7 * k),
    "query": lambda xp, a: lambda s, b, h, q, k: s * (1.0 + 0.05 * q),
    "float_table": lambda xp, a: lambda s, b, h, q, k: s + a["table"][b, h, k],
    "int_table": lambda xp, a: (
        lambda s, b, h, q, k: s - 0.2 * xp.abs(q - k + a["shift"][h]) + 0.1 * a["order"][k]
    ),
}
DSCORE = {"query": lambda s, b, h, q, k: 1.0 + 0.05 * q}  # d score / d s where it is not 1
ZIGZAG, CONTIGUOUS, GATHER = ("ring", True), ("ring", False), ("all_gather", False)
# name: (mesh, kv heads, window (None: causal), [(method, load balance), ...])
CASES = {
    "distance": ({"context": 8}, 2, None, [ZIGZAG]),
    "key": ({"data": 2, "context": 4}, 2, 5, [CONTIGUOUS]),
    "query": ({"context": 4, "tensor": 2}, 2, None, [GATHER]),
    # The batch over data and the heads over tensor: b and h must be the global ones.
    "float_table": ({"data": 2, "context": 2, "tensor": 2}, 2, 6, [ZIGZAG, GATHER]),
    # MQA with the query heads over tensor: every shard slices the one kv head.
    "int_table": ({"context": 4, "tensor": 2}, 1, None, [ZIGZAG, CONTIGUOUS]),
}


def _inputs(K, dtype, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(dtype)
    return dict(q=f(B, T, N, H), k=f(B, T, K, H), v=f(B, T, K, H), cotangent=f(B, T, N, H),
                table=0.5 * f(B, N, T), shift=SHIFT_N, order=ORDER_T)  # fmt: skip


def _mask(window):
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    return (s <= t) & (True if window is None else s > t - window)


def _reference(x, name, window):
    """Float64 NumPy: the output and the gradients of ``sum(out * cotangent)``."""
    score, dscore = SCORES[name](np, x), DSCORE.get(name)
    out, g = ref.flex_attention(
        x["q"], x["k"], x["v"], x["cotangent"], score=score, dscore=dscore, mask=_mask(window)
    )
    # d table[b, n, j] is the sum over t of d score, where the function adds the table.
    dtable = g["ds2"].sum(2) if name == "float_table" else np.zeros_like(x["table"])
    return out, (g["q"], g["k"], g["v"], dtable)


def _parallel(x, name, mesh, window, method, load_balance):
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))

    def f(q, k, v, table, shift, order):
        score = SCORES[name](jnp, {"table": table, "shift": shift, "order": order})
        arrays = (q, k, v, pos)
        if load_balance:  # attend in the zigzag layout, return in token order
            arrays = cp.zigzag(arrays, mesh=mesh)
        q, k, v, p = arrays
        out = cp.context_parallel_attention(
            q, k, v, mesh=mesh, method=method, q_pos_BT=p, k_pos_BS=p, causal=True,
            window=window, score_mod=score, load_balance=load_balance,
        )  # fmt: skip
        if load_balance:
            out = cp.zigzag(out, mesh=mesh, inverse=True)
        return (out * x["cotangent"]).sum(), out

    grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = grad(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "table", "shift", "order")))
    return out, grads


def _errors(got, want):
    out, grads = got
    return [float(np.abs(np.asarray(a, np.float64) - b).max())
            for a, b in zip((out, *grads), (want[0], *want[1]), strict=True)]  # fmt: skip


@on_mesh
@pytest.mark.parametrize("name", list(CASES))
def test_score_functions_on_the_ring_and_the_all_gather_equal_float64(name):
    """Values and gradients (q, k, v and the closed-over float table) against the float64
    loop over the formula: the score function reads the tokens' indices in the zigzag
    layout too, and the global batch row and head where the batch and the heads are split."""
    sizes, K, window, runs = CASES[name]
    mesh = sharding.make_mesh(sizes)
    x = _inputs(K, np.float32)
    want = _reference(x, name, window)
    for method, load_balance in runs:
        errors = _errors(_parallel(x, name, mesh, window, method, load_balance), want)
        assert max(errors) < 2e-5, (method, load_balance, errors)  # out, dq, dk, dv, dtable


@on_mesh
def test_float64_inputs_compute_in_float64_on_the_ring_and_the_all_gather():
    """Under 64-bit mode the ring's logits, online softmax and gradients stay float64: the
    result equals the float64 loop to 1e-12, where float32 anywhere would leave ~1e-7."""
    mesh = sharding.make_mesh({"data": 2, "context": 4})
    with jax.enable_x64(True):
        x = _inputs(2, np.float64, seed=1)
        want = _reference(x, "float_table", 6)
        for method, load_balance in (ZIGZAG, GATHER):
            got = _parallel(x, "float_table", mesh, 6, method, load_balance)
            assert got[0].dtype == jnp.float64 and got[1][3].dtype == jnp.float64
            errors = _errors(got, want)
            assert max(errors) < 1e-12, (method, errors)


# Models ----------------------------------------------------------------------------------------


@on_mesh
@pytest.mark.parametrize(
    "mixer,method,sizes",
    [
        ("fox", "ring", {"data": 2, "context": 4}),
        ("mha", "all_gather", {"context": 4, "tensor": 2}),
    ],
)
def test_a_model_with_a_score_function_runs_context_parallel_as_on_one_device(mixer, method, sizes):
    """FoX (its forget gate a score function over the cumulative gates, summed in token
    order although the layers run in the zigzag layout) and ``mha`` with a logit cap: the
    loss, logits and every gradient equal one device's, and no ``[T, T]`` array is built
    (the stack did not fall back to dense attention)."""
    from test_context_parallel import on_mesh_equals_one_device

    settings = {"softcap": 2.0} if mixer == "mha" else {"bias_init": 2.0}
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_len=48,
        init_std=0.3, sliding_window=7, sliding_window_layers=(1,), mixer=mixer,
        mixer_settings=settings, context_parallel=method, attention_impl="reference",
    )  # fmt: skip
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(1, 64, (4, 48)), jnp.int32)
    valid = jnp.asarray(np.arange(48)[None, :] < np.array([[48], [40], [48], [13]]))

    def loss(model):
        out = model(ids, valid_BT=valid)
        return (out.logits.astype(jnp.float32) ** 2).mean() * 1e-2, out.logits

    compiled = on_mesh_equals_one_device(cfg, loss, sizes, logits_atol=2e-5)
    assert "48,48]" not in compiled.as_text()


# Without devices -------------------------------------------------------------------------------


def test_a_traced_score_function_runs_with_its_arrays_as_inputs():
    """``shard_scores.trace`` hoists every array a function closes over (float, integer)
    and evaluates the traced program with them, nested calls (``jit``, a custom JVP)
    inline; a function of the wrong shape or dtype is refused naming ``score_mod``."""
    table = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    shift = np.array([1, 2, 3], np.int32)

    def mod(s, b, h, q, k):
        t, sh = jnp.asarray(table), jnp.asarray(shift)
        return jax.nn.softplus(s) + t[h, jnp.clip(k + sh[h], 0, 3)]

    example = (
        np.linspace(-2, 2, 24, dtype=np.float32).reshape(1, 3, 1, 2, 4),
        np.zeros((1, 1, 1, 1, 1), np.int32),
        np.arange(3).reshape(1, 3, 1, 1, 1),
        np.arange(2).reshape(1, 1, 1, 2, 1),
        np.arange(4).reshape(1, 1, 1, 1, 4),
    )
    _, args = shard_scores.trace(mod, example)
    assert {a.dtype.kind for a in args} == {"f", "i"}

    @jax.jit
    def run(*example):
        fn, args = shard_scores.trace(mod, example)
        grad = jax.grad(lambda s: fn(s, *example[1:], *args).sum())(example[0])
        return fn(*example, *args), mod(*example), grad

    got, want, grad = run(*example)
    np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(grad, jax.nn.sigmoid(example[0]), rtol=1e-6)
    with pytest.raises(ValueError, match="score's shape"):
        shard_scores.trace(lambda s, b, h, q, k: s.sum(), example)
    with pytest.raises(ValueError, match="float logits"):
        shard_scores.trace(lambda s, b, h, q, k: (s > 0) & (q >= 0), example)
    with pytest.raises(ValueError, match="five positional"):
        shard_scores.trace(lambda s, b: s, example)


@pytest.mark.skipif(CHILD, reason="a context axis of one device: the parent runs it")
def test_a_ring_of_one_device_runs_a_score_function_in_a_layer_scan():
    """The ring on a context axis of one device, in a scan over layers whose score
    functions close over each layer's float table and integer shift (traced): values and
    gradients (q and the tables) equal the reference path's."""
    x = _inputs(2, np.float32)
    mesh = sharding.make_mesh({"context": 1})
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    tables = jnp.stack([jnp.asarray(x["table"]), -jnp.asarray(x["table"])])
    shifts = jnp.asarray(np.stack([SHIFT_N, SHIFT_N[::-1]]))
    mod = lambda t, sh: lambda s, b, h, q, k: s + t[b, h, k] - 0.2 * jnp.abs(q - k + sh[h])

    def ring(q, t, sh):
        return cp.context_parallel_attention(
            q, x["k"], x["v"], mesh=mesh, q_pos_BT=pos, k_pos_BS=pos, causal=True,
            score_mod=mod(t, sh), load_balance=False,
        )  # fmt: skip

    def dense(q, t, sh):
        kw = dict(mask=np.tril(np.ones((T, T), bool))[None, None], implementation="reference")
        return ops.dot_product_attention(q, x["k"], x["v"], score_mod=mod(t, sh), **kw)

    def loss(attend):
        def total(q, tables):
            layer = lambda c, ts: (c + (attend(q, *ts) * x["cotangent"]).sum(), None)
            return jax.lax.scan(layer, jnp.float32(0), (tables, shifts))[0]

        return jax.jit(jax.value_and_grad(total, argnums=(0, 1)))(jnp.asarray(x["q"]), tables)

    (got, got_grads), (want, want_grads) = loss(ring), loss(dense)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)
