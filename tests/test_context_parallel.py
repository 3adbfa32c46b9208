"""Context parallelism (ring and all-gather attention over the mesh's context axis) equals
dense attention on one device: the pure functions, models' losses and gradients, training.

The checks on a mesh run in a child process with 8 fake CPU devices, started by the first
test, as in ``test_sharding.py``; in the parent they skip. The child runs
``test_context_parallel_score_mods.py`` too (score functions on these paths).
"""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_flags

from attnlab import ModelConfig, build_model, ops
from attnlab.devices import sharding
from attnlab.ops import context_parallel as cp

REPO = pathlib.Path(__file__).resolve().parents[1]
CHILD = os.environ.get("ATTNLAB_MESH_CHILD") == "1"
on_mesh = pytest.mark.skipif(
    not CHILD, reason="runs in the child process with 8 CPU devices (see the test above)"
)


@pytest.mark.slow(reason="a second pytest process on 8 CPU devices compiles every sharded program")
def test_context_parallel_tests_pass_on_eight_cpu_devices():
    if CHILD:
        pytest.skip("this is the child process")
    score_mods = pathlib.Path(__file__).with_name("test_context_parallel_score_mods.py")
    xla_flags.run_on_devices(__file__, str(score_mods), timeout=600)


# Without devices -----------------------------------------------------------------------------


def test_zigzag_gives_every_device_the_same_causal_work():
    """In the zigzag layout, at every ring step after the first each device's chunk pair
    leaves exactly two of its four (query half, key half) blocks to compute; in the
    contiguous layout the last device does all its blocks and the first almost none."""
    T, C = 64, 4
    order = cp.zigzag_indices(T, C)
    assert sorted(order) == list(range(T))

    def blocks(pos_CT, halves):  # [step, device] -> blocks with an allowed entry
        out = np.zeros((C, C), int)
        for step in range(C):
            for me in range(C):
                q = np.split(pos_CT[me], halves)
                k = np.split(pos_CT[(me - step) % C], halves)
                out[step, me] = sum(
                    bool(cp.chunk_mask(a[None], b[None], causal=True).any()) for a in q for b in k
                )
        return out

    zig = blocks(order.reshape(C, T // C), 2)
    assert (zig[1:] == 2).all() and (zig[0] == 3).all()  # the diagonal chunk: 3 of 4 halves
    contiguous = blocks(np.arange(T).reshape(C, T // C), 2)
    assert contiguous.sum(0).tolist() == [3, 7, 11, 15]


def test_config_names_the_context_parallel_choices():
    assert ModelConfig(context_parallel="all_gather").context_parallel == "all_gather"
    with pytest.raises(ValueError, match=r"context_parallel='ring2'.*'all_gather'"):
        ModelConfig(context_parallel="ring2")
    with pytest.raises(ValueError, match="context_load_balance"):
        ModelConfig(context_load_balance="yes")


# Pure functions on 8 devices -------------------------------------------------------------------

B, T, N, H = 2, 32, 4, 8

# name: (mesh, (kv heads, causal, load balance, window, segments, padding, bias))
CASES = {
    "causal_gqa_zigzag": ({"context": 8}, (2, True, True, None, False, False, None)),
    "causal_mha_contiguous_relative_bias": (
        {"data": 2, "context": 4},
        (4, True, False, None, False, False, "relative"),
    ),
    # MQA with the query heads over tensor: every shard slices the one kv head.
    "window_segments_padding_mqa_heads_over_tensor": (
        {"context": 4, "tensor": 2},
        (1, True, True, 5, True, True, None),
    ),
    "bidirectional_alibi_padding_masked_rows": (
        {"data": 2, "context": 4},
        (2, False, False, None, True, True, "alibi"),
    ),
}


def _inputs(K, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    segments = np.repeat(np.array([[1, 2, 3, 0], [1, 1, 2, 2]]), T // 4, axis=1)  # 0: masked
    valid = np.arange(T)[None, :] < np.array([[T], [T - 7]])
    return dict(
        q=f(B, T, N, H),
        k=f(B, T, K, H),
        v=f(B, T, K, H),
        cotangent=f(B, T, N, H),
        segments=jnp.asarray(segments, jnp.int32),
        valid=jnp.asarray(valid),
        table=0.5 * f(8, N),
    )


def _bias(kind):
    if kind == "alibi":
        return ops.alibi_bias, ops.alibi_slopes(N)
    if kind == "relative":
        return lambda t, q, k: ops.relative_position_bias(t, q, k, bidirectional=False), None
    return None, None


def _dense(x, case):
    """Single-device reference attention with the dense mask functions, and its gradients."""
    K, causal, _, window, segments, padding, bias = case
    pos = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    fn, params = _bias(bias)
    mask = ops.combine(
        ops.causal(T) if causal else None,
        None if window is None else ops.sliding_window(T, window=window),
        ops.segment(x["segments"]) if segments else None,
        ops.padding(k_valid_BS=x["valid"]) if padding else None,
    )

    def f(q, k, v, table):
        params_ = table if bias == "relative" else params
        b = None if fn is None else fn(params_, pos, pos)
        out = ops.dot_product_attention(q, k, v, mask=mask, bias=b, implementation="reference")
        return (out * x["cotangent"]).sum(), out

    return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
        x["q"], x["k"], x["v"], x["table"]
    )


def _parallel(x, case, mesh, method):
    K, causal, load_balance, window, segments, padding, bias = case
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    fn, params = _bias(bias)

    def f(q, k, v, table, window):
        seg = x["segments"] if segments else None
        valid = x["valid"] if padding else None
        arrays = (q, k, v, pos, seg, valid)
        if load_balance:  # attend in the zigzag layout, return in token order
            arrays = cp.zigzag(arrays, mesh=mesh)
        q, k, v, p, seg, valid = arrays
        out = cp.context_parallel_attention(
            q, k, v, mesh=mesh, method=method, q_pos_BT=p, k_pos_BS=p, causal=causal,
            window=window, q_segment_BT=seg, k_segment_BS=seg, k_valid_BS=valid, bias_fn=fn,
            bias_params=table if bias == "relative" else params, load_balance=load_balance,
        )  # fmt: skip
        if load_balance:
            out = cp.zigzag(out, mesh=mesh, inverse=True)
        return (out * x["cotangent"]).sum(), out

    grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
    return grad(x["q"], x["k"], x["v"], x["table"], window)  # the window traced


@on_mesh
@pytest.mark.parametrize("name", list(CASES))
def test_ring_and_all_gather_equal_dense_attention(name):
    sizes, case = CASES[name]
    x = _inputs(case[0])
    mesh = sharding.make_mesh(sizes)
    (_, want), want_grads = _dense(x, case)
    if case[4]:  # the rows of segment 0 attend to nothing: zeros, as the reference gives
        assert float(jnp.abs(want[0, 3 * T // 4 :]).max()) == 0.0
    for method in cp.METHODS:
        (_, got), grads = _parallel(x, case, mesh, method)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=method)
        names = ("dq", "dk", "dv", "dtable")
        for g, w, what in zip(grads, want_grads, names, strict=True):
            assert np.isfinite(np.asarray(g)).all(), (method, what)
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=f"{method} {what}")


@on_mesh
def test_zigzag_layout_and_batch_placement_on_a_context_mesh():
    mesh = sharding.make_mesh({"data": 2, "context": 4})
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    moved = jax.jit(lambda x: cp.zigzag(x, mesh=mesh))(x)
    np.testing.assert_array_equal(moved, x[:, cp.zigzag_indices(16, 4)])
    np.testing.assert_array_equal(cp.zigzag(moved, mesh=mesh, inverse=True), x)
    # Batches: rows over data, the sequence over context (a length it cannot split stays whole).
    rules = sharding.resolve_rules()
    placed = sharding.place_batch(
        {"inputs": np.zeros((4, 16), np.int32), "odd": np.zeros((4, 6), np.int32)}, mesh, rules
    )
    assert placed["inputs"].sharding.shard_shape((4, 16)) == (2, 4)
    assert placed["odd"].sharding.shard_shape((4, 6)) == (2, 6)


@on_mesh
def test_attention_dropout_on_the_ring_is_a_dropout_with_its_own_gradients():
    """Dropout on the ring's blocks: the key decides the bits, the mean over keys is the
    dense output, and the custom backward pass drops the same entries as the forward
    (its gradient against a finite difference, with a relative-bias table)."""
    mesh = sharding.make_mesh({"data": 2, "context": 4})
    x = _inputs(2)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    fn, _ = _bias("relative")

    def attend(q, k, v, table, key):
        return cp.context_parallel_attention(
            q, k, v, mesh=mesh, q_pos_BT=pos, k_pos_BS=pos, causal=True, load_balance=False,
            bias_fn=fn, bias_params=table, dropout_rate=0.1, dropout_key=key,
        )  # fmt: skip

    run = jax.jit(attend)
    args = (x["q"], x["k"], x["v"], x["table"])
    keys = jax.random.split(jax.random.key(0), 32)
    outs = np.stack([np.asarray(run(*args, k)) for k in keys])
    assert np.isfinite(outs).all() and np.abs(outs[0] - outs[1]).max() > 0.01
    bias = fn(x["table"], pos, pos)
    want = ops.dot_product_attention(*args[:3], mask=ops.causal(T), bias=bias)
    assert np.abs(outs.mean(0) - want).mean() < 0.1 * np.abs(want).mean()
    # The gradient along a random direction against a central difference (the same bits).
    loss = lambda *a: (run(*a, keys[0]) * x["cotangent"]).sum()
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    rng = np.random.default_rng(3)
    direction = [jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in args]
    eps = 1e-2
    moved = lambda sign: loss(*[a + sign * eps * d for a, d in zip(args, direction, strict=True)])
    numeric = (float(moved(1)) - float(moved(-1))) / (2 * eps)
    analytic = sum(float((g * d).sum()) for g, d in zip(grads, direction, strict=True))
    np.testing.assert_allclose(analytic, numeric, rtol=1e-3)


# Models and training on 8 devices --------------------------------------------------------------


def _model_case(position, method):
    """A decoder with GQA, a window on its second layer only, packed documents and padding,
    and its loss (a function of the model) with the logits."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_len=48,
        init_std=0.3, position=position, relative_buckets=8, relative_max_distance=16,
        sliding_window=7, sliding_window_layers=(1,), context_parallel=method,
    )  # fmt: skip
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(1, 64, (4, 48)), jnp.int32)
    valid = jnp.asarray(np.arange(48)[None, :] < np.array([[48], [40], [48], [13]]))
    segments = jnp.asarray(np.repeat(np.array([[1, 1, 2], [1, 2, 3]] * 2), 16, axis=1))

    def loss(model):
        out = model(ids, valid_BT=valid, segment_ids_BT=segments)
        return (out.logits.astype(jnp.float32) ** 2).mean() * 1e-2, out.logits

    return cfg, loss


def on_mesh_equals_one_device(cfg, loss, sizes, *, logits_atol):
    """``loss`` (model -> (value, logits)) of ``cfg``'s model and its gradients, compiled on
    a mesh of ``sizes``, equal one device's; returns the compiled program."""
    from flax import nnx

    graphdef, params = nnx.split(build_model(cfg, seed=0))

    def value_and_grad(params):
        return jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p)), has_aux=True)(params)

    (want, want_logits), want_grads = jax.jit(value_and_grad)(params)
    with sharding.activate(sharding.make_mesh(sizes), sharding.resolve_rules()):
        compiled = jax.jit(value_and_grad).lower(params).compile()
        (got, got_logits), grads = compiled(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_logits, want_logits, atol=logits_atol, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    return compiled


@on_mesh
@pytest.mark.parametrize("position,method", [("alibi", "ring"), ("relative", "all_gather")])
def test_model_loss_and_gradients_with_context_parallelism_equal_one_device(position, method):
    cfg, loss = _model_case(position, method)
    # The all-gather with the heads (4 q, 2 kv) split over tensor as well.
    sizes = {"data": 2, "context": 4} if method == "ring" else {"context": 4, "tensor": 2}
    compiled = on_mesh_equals_one_device(cfg, loss, sizes, logits_atol=1e-5)
    # No [T, T] mask, bias or score array anywhere in the program; on the ring not even
    # this device's T/C queries over all T keys.
    text = compiled.as_text()
    assert "48,48]" not in text
    assert method != "ring" or "12,48]" not in text


def _training(sizes, steps=3):
    from test_sharding import batches, run_steps, tiny

    from attnlab.train import Trainer

    cfg = tiny(dropout=0.0, attention_dropout=0.0, max_len=32)  # dropout bits follow the layout
    cfg.data.seq_len = 32
    data = [
        {k: np.concatenate([v, v[:, ::-1]], axis=1) for k, v in b.items()} for b in batches(steps)
    ]  # T = 32
    mesh = None if sizes is None else sharding.make_mesh(sizes)
    trainer = Trainer(cfg, kind="lm", mesh=mesh)
    return run_steps(trainer, trainer.init_state(), data)[1]


@on_mesh
def test_training_with_context_parallelism_equals_one_device():
    want = _training(None)
    got = _training({"data": 2, "context": 4})  # the load-balanced ring
    np.testing.assert_allclose(got, want, rtol=1e-5)


@on_mesh
def test_a_sequence_the_context_axis_cannot_split_fails_naming_both():
    cfg, loss = _model_case("alibi", "ring")
    model = build_model(cfg, seed=0)
    mesh = sharding.make_mesh({"data": 2, "context": 4})
    fails = pytest.raises(sharding.MeshError, match=r"length 12 must be a multiple of 8")
    with sharding.activate(mesh, sharding.resolve_rules()), fails:
        jax.jit(lambda ids: model(ids).logits)(jnp.zeros((2, 12), jnp.int32))
