"""A write past a linear cache's capacity is never a silent wrong answer, and a float64 model
samples and measures in float64.

Overflow (``init_cache(..., on_overflow=...)``): a hand-written ``nnx.jit`` or ``jax.jit``
decoding loop raises with the ``DecodeError`` line by default (``"raise"``); ``"flag"``
returns with ``cache.overflow`` set; eager calls and ``checked_jit`` raise a
``DecodeError`` as before; a ring never raises; a program built for another platform holds
no host callback. float64: sampling's filtered logits and the metrics' values against
float64 NumPy, under JAX's 64-bit mode.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import ModelConfig, build_model, init_cache
from attnlab.decode import SamplingConfig, filter_logits, sample
from attnlab.decode.checks import checked_jit
from attnlab.errors import DecodeError
from attnlab.kv_cache import check_capacity
from attnlab.ops import paths
from attnlab.train.state import zeros_acc

SMALL = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=16)
LINE = (
    "the cache holds 4 tokens per row but row {b} asks for {need} ({held} held + {new} new): "
    "pass a larger max_len to init_cache, or use a ring cache (init_cache(..., ring=True)) for "
    "a sliding-window model"
)


@pytest.fixture(scope="module")
def model():
    """A sliding-window model: its caches are linear up to the window, or a ring."""
    return build_model(ModelConfig(**SMALL, sliding_window=4), seed=0)


def _body(model, ids, cache):
    out = model(ids, cache=cache)
    return out.logits, out.cache


def _last_line(error) -> str:
    return str(error).strip().splitlines()[-1]


def test_a_jitted_loop_past_a_linear_cache_raises_the_line_by_default(model):
    step = nnx.jit(_body)
    cache = init_cache(model.cfg, 2, 4)
    assert cache.on_overflow == "raise"
    one = jnp.asarray([[3], [5]])
    for _ in range(4):  # exactly full is fine
        _, cache = step(model, one, cache)
    # JAX raises the host's error as its own (JaxRuntimeError, or ValueError from the fast
    # dispatch path): the line is the last line of its text
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError)) as e:
        step(model, one, cache)
    assert _last_line(e.value) == "DecodeError: " + LINE.format(b=0, need=5, held=4, new=1)
    # a plain jax.jit prefill that does not fit a fresh cache, on its first call
    prefill = jax.jit(lambda ids, cache: _body(model, ids, cache))
    ids = jnp.asarray([[1, 2, 3], [1, 2, 3]])
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError)) as e:
        prefill(ids, init_cache(model.cfg, 2, 4).replace(lengths=jnp.asarray([0, 2])))
    assert _last_line(e.value) == "DecodeError: " + LINE.format(b=1, need=5, held=2, new=3)
    # the check is a pure callback behind a cond: no effect, so the fast dispatch stays
    jaxpr = jax.make_jaxpr(lambda ids, cache: _body(model, ids, cache))(one, cache)
    assert "pure_callback" in str(jaxpr) and not jaxpr.effects


def test_flag_returns_with_the_overflow_set_and_adds_nothing(model):
    step = nnx.jit(_body)
    cache = init_cache(model.cfg, 1, 4, on_overflow="flag")
    for _ in range(5):
        _, cache = step(model, jnp.asarray([[3]]), cache)
    assert np.asarray(cache.overflow).tolist() == [True] and cache.on_overflow == "flag"
    with pytest.raises(DecodeError, match=r"^the cache holds 4 tokens per row but row 0 asks"):
        check_capacity(cache)
    jaxpr = jax.make_jaxpr(lambda ids, cache: _body(model, ids, cache))(jnp.asarray([[3]]), cache)
    assert "callback" not in str(jaxpr) and "cond" not in str(jaxpr)
    with pytest.raises(ValueError, match=r"on_overflow='stop' must be 'raise' .* or 'flag'"):
        init_cache(model.cfg, 1, 4, on_overflow="stop")


@pytest.mark.parametrize("on_overflow", ["raise", "flag"])
def test_eager_and_checked_jit_calls_raise_a_decode_error_either_way(model, on_overflow):
    cache = init_cache(model.cfg, 1, 4, on_overflow=on_overflow)
    cache = cache.replace(lengths=jnp.asarray([4]))
    with pytest.raises(DecodeError) as e:  # eager: refused before any write
        model(jnp.asarray([[3]]), cache=cache)
    assert str(e.value) == LINE.format(b=0, need=5, held=4, new=1)
    with pytest.raises(DecodeError) as e:  # checkify's check, not the callback
        checked_jit(_body, jit=nnx.jit)(model, jnp.asarray([[3]]), cache)
    assert str(e.value).startswith("the cache holds 4 tokens per row but a row asks for 5 ")


def test_a_ring_cache_never_raises(model):
    step = nnx.jit(_body)
    cache = init_cache(model.cfg, 1, 8, ring=True)  # 4 slots, 8 positions
    assert cache.ring and cache.on_overflow == "raise"
    for _ in range(6):  # past the window: the ring wraps by design
        _, cache = step(model, jnp.asarray([[3]]), cache)
    assert np.asarray(cache.overflow).tolist() == [False]
    jaxpr = jax.make_jaxpr(lambda ids, cache: _body(model, ids, cache))(jnp.asarray([[3]]), cache)
    assert "callback" not in str(jaxpr)


def test_a_program_built_for_another_platform_holds_no_callback(model):
    cache = init_cache(model.cfg, 1, 4)
    other = "tpu" if jax.default_backend() != "tpu" else "cpu"
    with paths.target(other):
        assert paths.lowering_only()
        jaxpr = jax.make_jaxpr(lambda ids, cache: _body(model, ids, cache))(
            jnp.asarray([[3]]), cache
        )
    assert "callback" not in str(jaxpr)


# float64 ----------------------------------------------------------------------------------
def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_sampling_a_float64_model_stays_in_float64():
    logits = np.random.default_rng(0).normal(size=(3, 11)) * 3.0
    log_probs = jax.jit(lambda x, s: jax.nn.log_softmax(filter_logits(x, s), axis=-1))
    with jax.enable_x64(True):
        settings = SamplingConfig(temperature=0.7, min_p=0.0).traced(np.float64)
        assert np.asarray(settings.temperature).dtype == np.float64
        got = log_probs(jnp.asarray(logits), settings)  # min-p traced: its float64 floor
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, _log_softmax(logits / 0.7), rtol=0, atol=1e-13)
        token = jax.jit(sample)(jnp.asarray(logits), jax.random.key(0), settings)
        assert token.shape == (3,) and token.dtype == jnp.int32
    # bfloat16 and float32 logits: float32, as before
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(logits, dtype)
        out = filter_logits(x, SamplingConfig(temperature=0.7))
        assert out.dtype == jnp.float32
        np.testing.assert_array_equal(out, x.astype(jnp.float32) / np.float32(0.7))


def test_the_metrics_of_a_float64_model_compute_in_float64():
    from attnlab.metrics.attn_qk_norm import head_products
    from attnlab.metrics.groups import group_norms
    from attnlab.metrics.moe_load_balance import MoELoadBalance

    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 8, 4, 3)), rng.normal(size=(2, 8, 2, 3))
    tree = {"attn": {"w": rng.normal(size=(5, 3))}, "ffn": {"w": rng.normal(size=(7,))}}
    aux = rng.normal(size=(4,)) * 1e-3 + 1.0  # per layer: differences below float32's step
    with jax.enable_x64(True):
        cfg = ModelConfig(**SMALL, dtype="float64", param_dtype="float64")
        metric = MoELoadBalance(cfg)
        assert metric.dtype == jnp.float64 and metric.zeros().dtype == jnp.float64
        view = types.SimpleNamespace(out=types.SimpleNamespace(aux={"load_balance": aux}))
        reading = metric.normalise(metric.value(view))
        reading = metric.combine(reading, metric.normalise((jnp.asarray(aux[:2].sum()), 1.0)))
        mean = metric.finish(reading)
        assert mean.dtype == jnp.float64
        assert float(mean) == (aux.sum() + aux[:2].sum()) / 2.0  # a metric's mean, exact
        norms = group_norms(jax.tree.map(jnp.asarray, tree), ("attn", "ffn"))
        for g, x in tree.items():
            assert norms[g].dtype == jnp.float64
            np.testing.assert_allclose(norms[g], np.sqrt(np.sum(x["w"] ** 2)), rtol=1e-15)
        got = head_products(jnp.asarray(q), jnp.asarray(k), 0.5)
        qn, kn = np.sqrt((q**2).sum((1, 3))), np.sqrt((k**2).sum((1, 3)))
        want = (qn * np.repeat(kn, 2, axis=1)).max(1) * 0.5
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, want, rtol=1e-15)
        acc = zeros_acc(cfg, [metric])  # the train state's accumulators
        assert {acc[k].dtype for k in ("loss_sum", "tokens", "grad_norm_sum")} == {np.dtype("f8")}
    for dtype in ("bfloat16", "float32"):  # as before: float32
        metric = MoELoadBalance(ModelConfig(**SMALL, dtype=dtype))
        assert metric.dtype == jnp.float32 and metric.zeros().dtype == jnp.float32
        assert zeros_acc(metric.mcfg, [metric])["loss_sum"].dtype == jnp.float32


def test_the_loss_sums_of_a_float64_model_are_float64():
    """``loss_sums`` (the eval loop's sums): the masked cross-entropy and the token count in
    float64, the loss against float64 NumPy."""
    from attnlab.train import loss_sums

    rng = np.random.default_rng(1)
    ids = rng.integers(0, SMALL["vocab_size"], (2, 6), dtype=np.int32)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], np.float64)
    with jax.enable_x64(True):
        model = build_model(ModelConfig(**SMALL, dtype="float64", param_dtype="float64"), seed=0)
        batch = dict(inputs=jnp.asarray(ids), targets=jnp.asarray(ids), loss_mask=mask)
        s, n, _ = loss_sums(model, batch, "lm")
        logits = np.asarray(model(jnp.asarray(ids)).logits)
    assert s.dtype == jnp.float64 and n.dtype == jnp.float64
    nll = -np.take_along_axis(_log_softmax(logits), ids[..., None], -1)[..., 0]
    assert float(n) == 10.0
    assert abs(float(s) - (nll * mask).sum()) < 1e-11


@pytest.mark.slow(reason="compiles a float64 train step and eval step (~13 s on 2 loaded cores)")
def test_a_float64_train_step_and_evaluation_accumulate_in_float64():
    from test_bad_inputs_startup import TINY

    from attnlab import experiment
    from attnlab.train import Trainer

    B, T = 2, 8
    rng = np.random.default_rng(0)
    batch = dict(inputs=rng.integers(0, 256, (B, T), dtype=np.int32),
                 targets=rng.integers(0, 256, (B, T), dtype=np.int32),
                 loss_mask=np.ones((B, T)))  # fmt: skip
    with jax.enable_x64(True):
        overrides = ["model.dtype=float64", "model.param_dtype=float64", "model.n_layers=1",
                     f"train.batch_size={B}", f"data.seq_len={T}"]  # fmt: skip
        trainer = Trainer(experiment.load_config(TINY, ["--config." + o for o in overrides]))
        state = trainer.init_state()
        logits = np.asarray(trainer.model(state["params"])(jnp.asarray(batch["inputs"])).logits)
        state, out = trainer.train_step(state, batch)
        assert out["loss"].dtype == jnp.float64
        assert {k: v.dtype for k, v in state["acc"].items() if k != "metrics"} == {
            "loss_sum": jnp.float64, "tokens": jnp.float64, "grad_norm_sum": jnp.float64,
            "steps": jnp.int32, "nonfinite": jnp.int32, "first_nonfinite": jnp.int32,
        }  # fmt: skip
        before = trainer.evaluate(jax.tree.map(jnp.asarray, state["params"]), [batch])
    want = -np.take_along_axis(_log_softmax(logits), batch["targets"][..., None], -1).mean()
    assert logits.dtype == np.float64
    assert abs(float(out["loss"]) - want) < 1e-12  # the step's loss, before its update
    assert np.isfinite(before["eval_loss"])
