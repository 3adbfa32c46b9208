"""Step metrics and auxiliary losses (``attnlab.metrics``): each built-in metric equals
a float64 NumPy computation from the parameters, selection and weights fail clearly, a run
resumes when its set of metrics changed, and metrics reduce on 8 devices as on one.

The tests that need a mesh run in a child process with 8 fake CPU devices, started by
``test_metrics_on_eight_cpu_devices``; in the parent they skip, saying so.
"""

import pathlib

import decoder_reference as dref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_flags
from flax import nnx
from xla_flags import on_mesh

from attnlab import experiment
from attnlab.devices import sharding
from attnlab.errors import ConfigError
from attnlab.train import Trainer, loss_sums
from attnlab.train.state import reconcile_acc

REPO = pathlib.Path(__file__).resolve().parents[1]
ALL = (
    "attn_max_logit", "attn_qk_norm", "attn_entropy", "attn_first_share", "residual_rms",
    "residual_max", "grad_norms", "update_norms",
)  # fmt: skip
B, T, V = 2, 8, 16


def tiny(*overrides, **model):
    cfg = experiment.load_config(f"{REPO / 'experiments' / 'char_lm.py'}:tiny", list(overrides))
    cfg.model.update(
        dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=T, ffn="gelu",
             dropout=0.0, attention_dropout=0.0) | model
    )  # fmt: skip
    cfg.data.seq_len = T
    cfg.train.batch_size = B
    if not any("train.metrics" in o for o in overrides):
        cfg.train.metrics = ALL
    cfg.optim.update(warmup_steps=0)
    return cfg


def batch(seed=0, B=B):
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.integers(0, V, (B, T), dtype=np.int32),
        "targets": rng.integers(0, V, (B, T), dtype=np.int32),
        "loss_mask": (rng.random((B, T)) < 0.8).astype(np.float32),
    }


def pure(state):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(state)))


@pytest.fixture(scope="module")
def stepped():
    """One train step of a tiny decoder with every built-in metric on."""
    cfg = tiny()
    trainer = Trainer(cfg, kind="lm")
    state = trainer.init_state()
    before = pure(state["params"])
    mean_ce = lambda p: (lambda s, n: s / n)(*loss_sums(trainer.model(p), batch(), "lm")[:2])
    g = jax.jit(jax.grad(mean_ce))(state["params"])
    state, out = trainer.train_step(state, batch())
    acc = jax.device_get(state["acc"])
    mcfg = trainer.mcfg
    _, _, traces = dref.decoder(before, batch()["inputs"], n_layers=2, eps=mcfg.norm_eps)
    return dict(
        trainer=trainer, before=before, after=pure(state["params"]), grads=pure(g),
        values=jax.tree.map(np.asarray, out["metrics"]), record=trainer.metric_records(acc),
        traces=traces, mcfg=mcfg,
    )  # fmt: skip


def _attention(trace):
    logits, w, mask = trace["logits"], trace["weights"], trace["mask"]
    plogp = np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0)
    return {
        "max_logit": np.max(np.where(mask, logits, -np.inf)),
        "entropy": np.mean(-plogp.sum(-1)),
        "first": np.mean(w[..., 0]),
    }


def _groups(tree):
    """Group norms as the metric's docstring defines them, from the path names."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if names[0] in ("embed", "head", "mtp"):
            g = names[0]
        elif any("norm" in n for n in names):
            g = "norm"
        elif "attn" in names:
            g = "attn"
        elif "ffn" in names:
            g = "ffn"
        else:
            g = "other"
        out[g] = out.get(g, 0.0) + float(np.sum(np.asarray(x, np.float64) ** 2))
    return {g: np.sqrt(s) for g, s in out.items()}


@pytest.mark.parametrize("name", ALL)
def test_each_metric_equals_numpy_from_the_parameters(stepped, name):
    got = stepped["values"][name]
    traces = stepped["traces"]
    att = [_attention(t) for t in traces]
    res = [t["residual"] for t in traces]
    if name == "attn_max_logit":
        want = [a["max_logit"] for a in att]
    elif name == "attn_entropy":
        want = [a["entropy"] for a in att]
    elif name == "attn_first_share":
        want = [a["first"] for a in att]
    elif name == "residual_rms":  # the step value is the mean square; the log line its root
        want = [np.mean(r**2) for r in res]
        np.testing.assert_allclose(stepped["record"][name], np.sqrt(want), rtol=2e-5)
    elif name == "residual_max":
        want = [np.abs(r).max() for r in res]
    elif name == "attn_qk_norm":
        a = stepped["before"]["decoder"]["layers"]["attn"]
        q, k = np.asarray(a["q_DNH"], np.float64), np.asarray(a["k_DKH"], np.float64)
        H = q.shape[-1]
        want = [
            max(np.linalg.norm(q[i][:, n]) * np.linalg.norm(k[i][:, n]) for n in range(2)) * H**-0.5
            for i in range(2)
        ]
    elif name in ("grad_norms", "update_norms"):
        if name == "grad_norms":
            want = _groups(stepped["grads"])
        else:
            delta = jax.tree.map(lambda a, b: a - b, stepped["after"], stepped["before"])
            want = _groups(delta)
        assert sorted(got) == sorted(want)
        for g in want:
            np.testing.assert_allclose(got[g], want[g], rtol=2e-4, err_msg=g)
        return
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


def test_unknown_metric_and_bad_weight_fail_naming_the_key():
    with pytest.raises(ConfigError, match=r"'attn_max_logits'.*did you mean attn_max_logit"):
        experiment.validate(tiny("--config.train.metrics=('attn_max_logits',)"))
    with pytest.raises(ConfigError, match=r"model.mtp_depth=0"):
        experiment.validate(tiny("--config.train.metrics=('mtp',)"))
    with pytest.raises(ConfigError, match=r"train.loss_weights.mtp=-1.0"):
        experiment.validate(tiny("--config.train.loss_weights.mtp=-1.0"))


def test_accumulators_of_another_metric_set_are_fitted_not_refused():
    empty = {"steps": jnp.zeros((), jnp.int32), "metrics": {"new": jnp.full((2,), -jnp.inf)}}
    old = {"steps": jnp.asarray(3, jnp.int32), "metrics": {"gone": jnp.ones(())}}
    got = reconcile_acc(old, empty)
    assert int(got["steps"]) == 3 and set(got["metrics"]) == {"new"}
    assert np.all(np.isneginf(got["metrics"]["new"]))


@pytest.mark.slow(reason="two training runs of the CLI's loop, with checkpoints")
def test_a_run_resumes_with_a_metric_its_checkpoint_was_written_without(tmp_path):
    from attnlab.runs import train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 200)
    cfg = tiny(f"--config.data.path={corpus}")
    cfg.model.vocab_size = 256
    cfg.train.update(steps=4, log_every_steps=1, metrics=())
    cfg.checkpoint.update(every_steps=2)
    cfg.eval.update(every_steps=100, batches=0, sample_tokens=0)  # the corpus lacks "def "
    train(cfg, tmp_path / "run", progress=False, stop_after=2)
    cfg.train.metrics = ("attn_max_logit", "grad_norms")
    record = train(cfg, tmp_path / "run", progress=False, allow_changes=True)
    assert record["step"] == 4 and len(record["attn_max_logit"]) == 2
    assert record["grad_norms/attn"] > 0


@pytest.mark.slow(reason="a second pytest process on 8 CPU devices compiles the sharded steps")
def test_metrics_on_eight_cpu_devices():
    xla_flags.run_on_devices(__file__, "-k", "mesh or devices")


@on_mesh
@pytest.mark.parametrize("shape", [(2, 2, 2)])
def test_metrics_reduce_on_a_mesh_as_on_one_device(shape):
    cfg = tiny("--config.optim.grad_accum_steps=2", "--config.model.n_kv_heads=2")
    cfg.train.batch_size = 16
    data = [batch(s, B=16) for s in range(2)]

    def run(mesh):
        trainer = Trainer(cfg, kind="lm", mesh=mesh)
        state = trainer.init_state()
        values = []
        for b in data:
            state, out = trainer.train_step(state, b)
            values.append(jax.tree.map(np.asarray, jax.device_get(out["metrics"])))
        return values, trainer.metric_records(jax.device_get(state["acc"]))

    one, one_record = run(None)
    mesh = sharding.make_mesh(dict(zip(("data", "fsdp", "tensor"), shape, strict=True)))
    many, many_record = run(mesh)
    for a, b in zip(jax.tree.leaves(many), jax.tree.leaves(one), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert many_record.keys() == one_record.keys()
