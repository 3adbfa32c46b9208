"""Experiment configs, the train step, the loop, checkpoint resume and the CLI."""

import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import experiment, train
from attnlab.data import make_task

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((REPO / "experiments").glob("*.py"))


def tiny(name, *overrides):
    return experiment.load_config(f"{REPO / 'experiments' / name}:tiny", list(overrides))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_experiment_builds_and_takes_a_step(path, tmp_path):
    cfg = experiment.load_config(f"{path}:tiny")
    if cfg.data.path:  # text experiments read a file; use a small one made here
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("To be, or not to be, that is the question.\n" * 200)
        cfg.data.path = str(corpus)
    mcfg = experiment.validate(cfg)
    task = make_task(cfg.data, tmp_path)
    trainer = train.Trainer(cfg, mcfg, kind=task.kind)
    state = trainer.init_state()
    before = jax.tree.map(np.asarray, state["params"])
    state, metrics = trainer.train_step(state, task.train_batch(0, 0, int(cfg.train.batch_size)))
    assert math.isfinite(float(metrics["loss"])) and int(state["step"]) == 1
    moved = [
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state["params"]), strict=True)
    ]
    assert any(moved)


def test_every_experiment_accepts_the_common_keys():
    keys = [
        "train.steps=7",
        "train.batch_size=4",
        "train.seed=3",
        "optim.learning_rate=0.01",
        "eval.every_steps=5",
        "checkpoint.every_steps=5",
        "model.n_layers=1",
        "data.path=somewhere.txt",
    ]
    for path in EXPERIMENTS:
        cfg = experiment.load_config(f"{path}:tiny", [f"--config.{k}" for k in keys])
        assert (cfg.train.steps, cfg.train.seed, cfg.model.n_layers) == (7, 3, 1)
        assert cfg.optim.learning_rate == 0.01 and cfg.data.path == "somewhere.txt"


def test_short_run_lowers_the_loss(tmp_path):
    cfg = tiny(
        "char_lm.py",
        "--config.train.steps=60",
        "--config.eval.every_steps=30",
        "--config.eval.sample_tokens=0",
        "--config.optim.learning_rate=0.01",
        "--config.optim.warmup_steps=5",
        "--config.train.log_every_steps=10",
        "--config.checkpoint.every_steps=60",
    )
    train.train(cfg, tmp_path, progress=False)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    assert last["train_loss"] < first["train_loss"] - 1.0
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert evals[-1] < evals[0]
    for key in (
        "step",
        "train_loss",
        "eval_loss",
        "learning_rate",
        "grad_norm",
        "tokens_per_sec",
        "elapsed_sec",
    ):
        assert key in last
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 60


DETERMINISTIC = ("step", "train_loss", "learning_rate", "grad_norm", "eval_loss", "eval_accuracy")


def _metrics(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in map(json.loads, lines)]


def _final_params(workdir, cfg):
    _, trainer, _, params, step = train.load_run(workdir)
    return step, jax.tree.leaves(params)


@pytest.mark.parametrize("stop", [3, 5])
def test_resume_is_exact(tmp_path, stop):
    overrides = [
        "--config.train.steps=8",
        "--config.eval.every_steps=4",
        "--config.eval.sample_tokens=0",
        "--config.train.log_every_steps=2",
        "--config.checkpoint.every_steps=4",
        "--config.model.dropout=0.1",
    ]
    cfg = tiny("char_lm.py", *overrides)
    train.train(cfg, tmp_path / "straight", progress=False)
    train.train(
        tiny("char_lm.py", *overrides), tmp_path / "resumed", progress=False, stop_after=stop
    )
    train.train(tiny("char_lm.py", *overrides), tmp_path / "resumed", progress=False)
    assert _metrics(tmp_path / "straight") == _metrics(tmp_path / "resumed")
    s1, p1 = _final_params(tmp_path / "straight", cfg)
    s2, p2 = _final_params(tmp_path / "resumed", cfg)
    assert s1 == s2 == 8
    for a, b in zip(p1, p2, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sigterm_leaves_a_restorable_checkpoint(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "attnlab.cli",
        "train",
        "--no-progress",
        "--config",
        f"{REPO / 'experiments' / 'char_lm.py'}:tiny",
        "--workdir",
        str(tmp_path),
        "--config.train.steps=100000",
        "--config.eval.every_steps=100000",
        "--config.checkpoint.every_steps=100000",
        "--config.train.log_every_steps=5",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    for line in proc.stdout:
        if line.startswith("step=10 "):
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM" in out
    _, trainer, _, params, step = train.load_run(tmp_path)
    assert 10 <= step < 100000
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "override,needle",
    [
        ("--config.train.stepz=5", "stepz"),
        ("--config.train.steps=abc", "train.steps"),
        ("--config.train.steps=1.5", "train.steps"),
        ("--config.nosuchgroup.x=1", "nosuchgroup"),
    ],
)
def test_invalid_overrides_name_the_key(override, needle):
    with pytest.raises(experiment.ExperimentError, match=needle):
        tiny("char_lm.py", override)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("--config.train.steps=0", "train.steps"),
        ("--config.model.position=spiral", "model.position"),
        ("--config.model.n_kv_heads=3", "model.n_kv_heads"),
        ("--config.data.kind=poetry", "data.kind"),
        ("--config.optim.grad_accum_steps=3", "optim.grad_accum_steps"),
        ("--config.data.seq_len=64", "data.seq_len"),
        ("--config.model.arch=encoder", "model.arch"),
    ],
)
def test_invalid_values_name_the_key(override, needle):
    with pytest.raises(experiment.ExperimentError, match=needle):
        experiment.validate(tiny("char_lm.py", override))


def test_cli_reports_bad_override_cleanly(tmp_path, capsys):
    from attnlab.cli import main

    code = main(
        [
            "train",
            "--config",
            str(REPO / "experiments" / "char_lm.py:tiny"),
            "--workdir",
            str(tmp_path),
            "--config.model.n_layer=2",
        ]
    )
    assert code == 2
    assert "n_layer" in capsys.readouterr().err


def test_vocabulary_larger_than_model_is_rejected(tmp_path):
    cfg = tiny("char_lm.py", "--config.model.vocab_size=10", "--config.model.pad_id=0")
    with pytest.raises(experiment.ExperimentError, match="model.vocab_size"):
        train.train(cfg, tmp_path, progress=False)


def test_workdir_with_another_model_is_refused(tmp_path):
    cfg = tiny("char_lm.py", "--config.eval.sample_tokens=0")
    train.train(cfg, tmp_path, progress=False)
    other = tiny("char_lm.py", "--config.model.d_model=48", "--config.eval.sample_tokens=0")
    with pytest.raises(experiment.ExperimentError, match="model.d_model"):
        train.train(other, tmp_path, progress=False)


def test_saved_config_reloads_to_the_same_config(tmp_path):
    cfg = tiny("char_lm.py", "--config.model.n_kv_heads=1", "--config.eval.sample_tokens=0")
    train.train(cfg, tmp_path, progress=False)
    again = experiment.load_config(str(tmp_path / "config.json"), ["--config.train.steps=9"])
    assert again.model.to_dict() == cfg.model.to_dict() and again.train.steps == 9


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    cfg1 = tiny("char_lm.py", "--config.train.batch_size=4")
    cfg2 = tiny("char_lm.py", "--config.train.batch_size=4", "--config.optim.grad_accum_steps=2")
    task = make_task(cfg1.data, tmp_path)
    batch = task.train_batch(0, 0, 4)
    results = []
    for cfg in (cfg1, cfg2):
        trainer = train.Trainer(cfg, kind="lm")
        state, m = trainer.train_step(trainer.init_state(), batch)
        results.append((float(m["loss"]), jax.tree.leaves(state["params"])))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for a, b in zip(results[0][1], results[1][1], strict=True):  # Adam amplifies rounding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_weight_decay_mask_spares_norms_biases_and_embeddings():
    cfg = tiny("mlm_encoder.py")
    trainer = train.Trainer(cfg, kind="mlm")
    mask = train.decay_mask(trainer.init_state()["params"])
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert any(v for k, v in flat.items() if "q_DNH" in k)
    assert any(v for k, v in flat.items() if "w_in_DF" in k)
    for k, v in flat.items():
        if any(s in k for s in ("scale_D", "bias", "embedding_VD", "table_PD")):
            assert not v, k


def test_schedule_is_warmup_then_cosine():
    o = experiment.base_config().optim
    o.update(warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    f = train.lr_multiplier(o, 110)
    assert float(f(0)) == pytest.approx(0.1)
    assert float(f(9)) == pytest.approx(1.0)
    for step in (10, 35, 60, 110):
        frac = (step - 10) / 100
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
        assert float(f(step)) == pytest.approx(expected, rel=1e-5)


def test_eval_matches_manual_loss(tmp_path):
    cfg = tiny("char_lm.py", "--config.eval.sample_tokens=0")
    train.train(cfg, tmp_path, progress=False)
    result = train.evaluate(tmp_path)
    _, trainer, task, params, _ = train.load_run(tmp_path)
    batch = task.eval_batches(int(cfg.eval.batch_size), 1)[0]
    logits = np.asarray(trainer.model(params)(jnp.asarray(batch["inputs"])).logits, np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    assert result["eval_loss"] == pytest.approx(nll.mean(), rel=1e-5)
