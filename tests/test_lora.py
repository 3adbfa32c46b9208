"""LoRA adapters (``attnlab.train.lora``): the update is a rank-r dense delta (float64
NumPy); merged weights give the outputs of the adapted forward pass, and reloaded from the
small adapter file too; a stage trains the adapters alone and resumes bitwise; on 8 fake
CPU devices (sharded parameters) it equals one device; targets that match nothing fail in
one line. A run's Trainer with adapters (``lora.rank``) on 8 devices (parameters sharded,
adapters replicated) trains as on one (the rest of a LoRA run: ``tests/test_lora_runs.py``)."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_flags
from flax import nnx

from attnlab import ModelConfig, build_model, experiment
from attnlab.data import make_task
from attnlab.devices import sharding
from attnlab.errors import ConfigError
from attnlab.train import Trainer, distill, lora

CHILD = os.environ.get("ATTNLAB_MESH_CHILD") == "1"
on_mesh = pytest.mark.skipif(not CHILD, reason="runs in the child process with 8 CPU devices")
CFG = ModelConfig(arch="decoder", vocab_size=40, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, max_len=16, position="rope", ffn="swiglu", d_ff=48,
                  norm="rmsnorm", init_std=0.2)  # fmt: skip
SPEC = lora.LoraSpec(rank=3, alpha=6.0, targets=("q", "v", "ffn"))


def trained_adapters(params, seed=0):
    """Adapters with B drawn too (fresh ones have B = 0, a zero update)."""
    ad = lora.init(SPEC, params, jax.random.key(seed))
    k = jax.random.key(seed + 1)
    return {
        n: {"a": a["a"], "b": 0.3 * jax.random.normal(jax.random.fold_in(k, i), a["b"].shape)}
        for i, (n, a) in enumerate(sorted(ad.items()))
    }


def test_the_update_is_a_dense_delta_of_rank_r_in_float64():
    params = nnx.state(build_model(CFG, seed=0))
    ad = trained_adapters(params)
    assert set(ad) == {
        "decoder.layers.attn.q_DNH", "decoder.layers.attn.v_DKH",
        "decoder.layers.ffn.w_gate_DF", "decoder.layers.ffn.w_in_DF", "decoder.layers.ffn.w_out_FD",
    }  # fmt: skip
    merged = nnx.to_pure_dict(lora.merge(SPEC, params, ad))
    base = nnx.to_pure_dict(params)
    for name, adapter in ad.items():
        keys = name.split(".")
        w0 = np.asarray(_get(base, keys), np.float64)
        w1 = np.asarray(_get(merged, keys), np.float64)
        a, b = (np.asarray(adapter[k], np.float64) for k in "ab")
        want = SPEC.scale * np.einsum("lir,lro->lio", a, b).reshape(w0.shape)
        np.testing.assert_allclose(w1 - w0, want, atol=1e-5)
        for layer in range(w0.shape[0]):  # each layer's update is a matrix of rank r
            assert np.linalg.matrix_rank(want[layer].reshape(a.shape[1], -1)) == SPEC.rank
    untouched = ["decoder", "layers", "attn", "k_DKH"]
    np.testing.assert_array_equal(_get(merged, untouched), _get(base, untouched))


def _get(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def test_merged_weights_equal_the_adapted_forward_and_survive_the_small_file(tmp_path):
    model = build_model(CFG, seed=0)
    graphdef, params = nnx.split(model)
    ad = trained_adapters(params)
    ids = jax.random.randint(jax.random.key(5), (2, 9), 0, CFG.vocab_size)
    # unmerged: the base forward plus each adapted q projection's own low-rank path
    x_BTD = jax.random.normal(jax.random.key(6), (2, 9, CFG.d_model))
    q = nnx.to_pure_dict(params)["decoder"]["layers"]["attn"]["q_DNH"][0]
    a, b = (ad["decoder.layers.attn.q_DNH"][k][0] for k in "ab")
    unmerged = jnp.einsum("BTD,DNH->BTNH", x_BTD, q) + SPEC.scale * (x_BTD @ a @ b).reshape(
        2, 9, CFG.n_heads, CFG.head_dim
    )
    q1 = nnx.to_pure_dict(lora.merge(SPEC, params, ad))["decoder"]["layers"]["attn"]["q_DNH"][0]
    np.testing.assert_allclose(jnp.einsum("BTD,DNH->BTNH", x_BTD, q1), unmerged, atol=1e-5)
    # the adapters alone, written and read back, merge into the same model
    path = lora.save(tmp_path / lora.FILE, SPEC, ad)
    spec2, ad2 = lora.load(path)
    assert spec2 == SPEC
    full = sum(x.size * 4 for x in jax.tree.leaves(params))
    assert path.stat().st_size < full / 4
    out = nnx.merge(graphdef, lora.merge(SPEC, params, ad))(ids).logits
    again = nnx.merge(graphdef, lora.merge(spec2, params, ad2))(ids).logits
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


def _stage(tmp_path, steps=4):
    from attnlab.transfer.stages import Stage

    return Stage("lora", tmp_path, student_cfg=CFG, teacher_cfg=CFG,
                 spec=distill.DistillSpec(ce=1.0, kl=0.5), lora_spec=SPEC, lr=1e-2, steps=steps,
                 warmup=1, log_every=1, checkpoint_every=100)  # fmt: skip


def _batches(step):
    rng = np.random.default_rng(step)
    rows = rng.integers(0, CFG.vocab_size, (2, 9)).astype(np.int32)
    from attnlab.transfer.stages import window_batch

    return window_batch(rows)


@pytest.mark.slow(reason="compiles a stage's train step twice and resumes it from orbax")
def test_only_adapters_train_and_a_stopped_stage_resumes_bitwise(tmp_path):
    base = nnx.state(build_model(CFG, seed=0))
    teacher = nnx.state(build_model(CFG, seed=1))
    base_copy = jax.tree.map(np.array, base)
    start = {"lora": lora.init(SPEC, base, jax.random.key(0)), "params": {}}
    whole = _stage(tmp_path / "a").run(start, base, teacher, _batches)
    assert _stage(tmp_path / "b").run(start, base, teacher, _batches, stop_after=2) is None
    resumed = _stage(tmp_path / "b").run(start, base, teacher, _batches)
    for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the base and the teacher are arguments: unchanged, and without optimiser state
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(base_copy), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    stage = _stage(tmp_path / "c")
    opt = stage.init_state(start)["opt_state"]
    n_adapters = lora.count(start["lora"])
    n_opt = sum(x.size for x in jax.tree.leaves(opt) if x.ndim)
    assert n_opt == 2 * n_adapters  # Adam's two moments of the adapters alone
    changed = [not np.array_equal(whole["lora"][n]["b"], 0) for n in whole["lora"]]
    assert all(changed)


def test_targets_that_match_nothing_fail_in_one_line():
    params = nnx.state(build_model(CFG, seed=0))
    spec = lora.spec_from({"rank": 4, "targets": ("*mlp.w_*",)})
    with pytest.raises(ConfigError, match=r"^lora\.targets=.*matches no weight") as e:
        lora.targets(spec, params)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        lora.spec_from({"rank": -1})
    assert lora.spec_from({"rank": 0}) is None


@pytest.mark.slow(reason="a second pytest process on 8 CPU devices compiles the sharded step")
def test_mesh_tests_pass_on_eight_cpu_devices():
    if CHILD:
        pytest.skip("this is the child process")
    xla_flags.run_on_devices(__file__)


def _loss_and_grads(params, ad, ids):
    graphdef = nnx.graphdef(build_model(CFG, seed=0))

    def loss(ad):
        logits = nnx.merge(graphdef, lora.merge(SPEC, params, ad))(ids).logits
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return jax.jit(jax.value_and_grad(loss))(ad)


@on_mesh
def test_on_eight_devices_it_equals_one():
    params = nnx.state(build_model(CFG, seed=0))
    ad = trained_adapters(params)
    ids = jax.random.randint(jax.random.key(5), (8, 9), 0, CFG.vocab_size)
    one = _loss_and_grads(params, ad, ids)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.resolve_rules()
    with sharding.activate(mesh, rules):
        placed = jax.device_put(params, sharding.tree_shardings(params, mesh, rules))
        ids_m = jax.device_put(ids, sharding.batch_sharding(mesh, rules))
        many = _loss_and_grads(placed, ad, ids_m)
    assert len(jax.devices()) == 8
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@on_mesh
def test_a_lora_trainer_on_eight_devices_trains_as_on_one():
    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "char_lm.py"
    cfg = experiment.load_config(f"{path}:tiny", [
        "--config.lora.rank=3", '--config.lora.targets=("q","v","ffn")',
        "--config.lora.dropout=0.25", "--config.optim.learning_rate=0.03",
        "--config.optim.warmup_steps=1", "--config.train.batch_size=8",
    ])  # fmt: skip
    task = make_task(cfg.data, None)
    batches = [task.train_batch(0, i, 8) for i in range(3)]
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    out = []
    for trainer in (Trainer(cfg), Trainer(cfg, mesh=mesh)):
        state, losses = trainer.init_state(), []
        for b in batches:
            state, m = trainer.train_step(state, b)
            losses.append(float(m["loss"]))
        out.append((state, losses))
    (one, losses1), (many, losses8) = out
    np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(one["lora"]), jax.tree.leaves(many["lora"]), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)
    for x, y in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(many["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))  # frozen on both
    q = many["params"]["decoder"]["layers"]["attn"]["q_DNH"]
    assert any(a is not None for a in q.sharding.spec)  # the base sharded
    for x in jax.tree.leaves(many["lora"]) + jax.tree.leaves(many["opt_state"]):
        assert x.sharding.is_fully_replicated  # the adapters and their moments replicated
