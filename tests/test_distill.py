"""Distillation objectives (``attnlab.train.distill``): the per-layer attention-output MSE
against a float64 NumPy computation on a tiny teacher (the student's layer fed the
teacher's layer input), logit KL with a temperature against NumPy, and the teacher takes
no gradient and has no optimiser state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_mixer_lolcats import lolcats_float64

from attnlab import ModelConfig, build_model
from attnlab.contracts.mixer import get_mixer
from attnlab.errors import ConfigError
from attnlab.inspect import run
from attnlab.nn import surgery
from attnlab.train import distill

TEACHER = ModelConfig(arch="decoder", vocab_size=40, d_model=32, n_layers=2, n_heads=4,
                      max_len=16, position="none", ffn="swiglu", d_ff=48, norm="rmsnorm",
                      init_std=0.3)  # fmt: skip


def _student(window=3):
    teacher = build_model(TEACHER, seed=0)
    cfg, params = surgery.replace_mixer(TEACHER, nnx.state(teacher), [0, 1], "lolcats",
                                        {"window": window}, init="matching")  # fmt: skip
    rng = np.random.default_rng(0)
    pure = nnx.to_pure_dict(params)
    attn = pure["decoder"]["layers"]["attn"]
    for k in ("feature_q_NHF", "feature_k_NHF"):  # away from the identity
        attn[k] = attn[k] + jnp.asarray(0.3 * rng.normal(size=attn[k].shape), jnp.float32)
    nnx.replace_by_pure_dict(params, pure)
    return teacher, cfg, params


def test_attention_mse_is_float64_numpy_on_a_tiny_teacher():
    teacher, cfg, params = _student(window=3)
    student = nnx.merge(nnx.graphdef(build_model(cfg, seed=0)), params)
    ids = jax.random.randint(jax.random.key(1), (2, 7), 0, 40)
    names = distill.teacher_names(distill.DistillSpec(ce=0, attention_mse=1), 2, (0, 1))
    logits, seen = distill.teacher_pass(teacher, ids, names)
    got = np.asarray(distill.attention_mse_per_layer(student, ids, seen, (0, 1), 2))
    _, cap = run(teacher, ids, capture=["layers.*.resid_pre", "layers.*.attn.out"])
    pure = nnx.to_pure_dict(params)["decoder"]["layers"]
    cls = get_mixer("lolcats")
    for i in (0, 1):
        x = np.asarray(cap[f"layers.{i}.resid_pre"], np.float64)
        scale = np.asarray(pure["attn_norm"]["scale_D"][i], np.float64)
        h = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + TEACHER.norm_eps) * scale
        layer = cls(cfg, cls.Settings(window=3), rngs=nnx.Rngs(0))
        for k, v in pure["attn"].items():
            getattr(layer, k)[...] = jnp.asarray(np.asarray(v)[i])
        want_out = lolcats_float64(h, layer, 3)
        teacher_out = np.asarray(cap[f"layers.{i}.attn.out"], np.float64)
        want = np.mean((want_out - teacher_out) ** 2)
        np.testing.assert_allclose(got[i], want, rtol=2e-4)
    assert got.min() > 0


def test_kl_with_a_temperature_is_numpy_and_zero_on_itself():
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(2, 3, 7)), rng.normal(size=(2, 3, 7))
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)

    def lsm(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    T = 2.0
    pt, ls = lsm(t / T), lsm(s / T)
    want = T * T * np.sum(np.sum(np.exp(pt) * (pt - ls), -1) * mask)
    got = distill.kl_sum(jnp.asarray(s), jnp.asarray(t), jnp.asarray(mask), T)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    assert abs(float(distill.kl_sum(jnp.asarray(s), jnp.asarray(s), jnp.asarray(mask)))) < 1e-5


def test_the_teacher_takes_no_gradient_and_no_optimiser_state():
    teacher, cfg, params = _student(window=0)
    graph = nnx.graphdef(build_model(cfg, seed=0))
    tgraph, tparams = nnx.split(teacher)
    spec = distill.DistillSpec(ce=1.0, kl=1.0, hidden=1.0, attention_mse=1.0)
    names = distill.teacher_names(spec, 2, (0, 1))
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, 40)
    batch = {"inputs": ids, "targets": ids, "loss_mask": jnp.ones((2, 8))}

    def loss(tparams, params):
        t_out = distill.teacher_pass(nnx.merge(tgraph, tparams), ids, names)
        student = nnx.merge(graph, params)
        return distill.objective(spec, student, batch, t_out, mse_layers=(0, 1), n_layers=2)[0]

    g_teacher, g_student = jax.grad(loss, argnums=(0, 1))(tparams, params)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_teacher))
    assert any(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(g_student))
    from attnlab.transfer.stages import optimizer

    trainable = {"w": params["decoder"]["layers"]["attn"]["feature_q_NHF"][...]}
    opt = optimizer(1e-2, 10, 1).init(trainable)
    assert sum(x.size for x in jax.tree.leaves(opt) if x.ndim) == 2 * trainable["w"].size


def test_bad_weights_name_the_field():
    with pytest.raises(ConfigError, match=r"distill\.kl=-1"):
        distill.spec_from({"kl": -1})
    with pytest.raises(ConfigError, match=r"distill\.temperature"):
        distill.spec_from({"temperature": 0})
    with pytest.raises(ConfigError, match="every weight is 0"):
        distill.spec_from({"ce": 0})
