"""Optuna searches: the spec, seeded suggestions, pruning inside a stacked group, resuming."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import run_checks

from attnlab import experiment, runs, sweep
from attnlab.experiment import ExperimentError

optuna = pytest.importorskip("optuna")

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE = [
    "--config.train.steps=4",
    "--config.train.log_every_steps=2",
    "--config.eval.every_steps=2",
    "--config.eval.sample_tokens=0",
    "--config.checkpoint.every_steps=2",
]
SEARCH = """

def sweep(variant=None):
    from attnlab.sweep import log_uniform, optuna_search

    return optuna_search(
        {"optim.learning_rate": log_uniform(1e-3, 3e-2), "train.seed": 0},
        num_trials=NUM, sampler="tpe", pruner="none", stack=STACK,
        sampler_options={"n_startup_trials": 2},
    )
"""


def _experiment(tmp_path, num=4, stack=2):
    path = tmp_path / "char_lm_search.py"
    source = SEARCH.replace("NUM", str(num)).replace("STACK", str(stack))
    path.write_text((REPO / "experiments" / "char_lm.py").read_text() + source)
    return f"{path}:tiny"


def _metrics(d):
    keys = ("step", "train_loss", "eval_loss")
    return [{k: r[k] for k in keys if k in r} for r in run_checks.records(d)]


def test_search_spec_mistakes_name_the_field():
    space = {"optim.learning_rate": sweep.log_uniform(1e-4, 1e-2)}
    with pytest.raises(ExperimentError, match="sampler='annealing'"):
        sweep.optuna_search(space, 4, sampler="annealing")
    with pytest.raises(ExperimentError, match="num_trials=0"):
        sweep.optuna_search(space, 0)
    with pytest.raises(ExperimentError, match="grid.*optim.learning_rate"):
        sweep.optuna_search(space, 4, sampler="grid")
    with pytest.raises(ExperimentError, match="unknown search field"):
        sweep.search.as_search({"method": "optuna", "space": space, "num_trials": 2, "x": 1})
    config = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
    with pytest.raises(ExperimentError, match="optim.learning_rat"):
        sweep.plan_search(
            config, [], {"method": "optuna", "space": {"optim.learning_rat": 1.0}, "num_trials": 2}
        )


@pytest.mark.slow  # two 4-trial searches, four stacked groups to compile: ~30 s on 2 cores
def test_a_seeded_tpe_study_suggests_the_same_trials_twice(tmp_path):
    config = _experiment(tmp_path)
    plan = sweep.load_sweep(config, BASE)
    assert isinstance(plan, sweep.SearchPlan)
    params = []
    for name in ("a", "b"):
        results = sweep.run_search(plan, tmp_path / name, log=lambda *_: None)
        study = optuna.load_study(
            study_name=name, storage=f"sqlite:///{tmp_path / name / 'study.db'}"
        )
        params.append([t.params for t in study.trials])
        assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4
        assert results["outcomes"]["finished"] == 4
        # every evaluation reached the study, the last one is the trial's value
        t0 = study.trials[0]
        assert sorted(t0.intermediate_values) == [2, 4]
        assert t0.value == _metrics(tmp_path / name / "trial-0000")[-1]["eval_loss"]
    assert params[0] == params[1]
    assert len({p["optim.learning_rate"] for p in params[0]}) == 4
    root = tmp_path / "a"
    best = json.loads((root / "best.json").read_text())
    assert best["value"] == min(t["final_eval_loss"] for t in results["trials"])
    assert best["config"]["optim"]["learning_rate"] == best["params"]["optim.learning_rate"]
    for png in ("param_importances.png", "parallel_coordinate.png", "loss_curves.png"):
        assert (root / png).stat().st_size > 0
    modes = {
        json.loads((root / f"trial-000{i}" / "status.json").read_text())["mode"] for i in range(4)
    }
    assert modes == {"vmap"}  # the learning rates of a batch stack


class PruneTrial1(optuna.pruners.BasePruner):
    """Prunes trial 1 at its first report, nothing else."""

    def prune(self, study, trial):
        return trial.number == 1


@pytest.mark.slow  # two searches of a 3-trial stacked group: ~25 s on 2 cores
def test_a_pruned_trial_stops_inside_its_stacked_group(tmp_path):
    config = _experiment(tmp_path, num=3, stack=3)
    base = sweep.load_sweep(config, [*BASE, "--config.train.steps=6"])
    outcomes = {}
    for name, pruner in (("pruned", PruneTrial1()), ("plain", "none")):
        search = sweep.search.as_search({**base.search.__dict__, "pruner": pruner})
        plan = sweep.SearchPlan(base.config, base.base_overrides, search, base.base)
        outcomes[name] = sweep.run_search(plan, tmp_path / name, log=lambda *_: None)
    study = optuna.load_study(study_name="pruned", storage=f"sqlite:///{tmp_path}/pruned/study.db")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert outcomes["pruned"]["outcomes"]["pruned"] == 1
    pruned, plain = tmp_path / "pruned", tmp_path / "plain"
    status = json.loads((pruned / "trial-0001" / "status.json").read_text())
    assert (status["status"], status["mode"], status["step"]) == ("pruned", "vmap", 2)
    assert [r["step"] for r in _metrics(pruned / "trial-0001")] == [2]
    assert runs.load_run(pruned / "trial-0001").step == 2
    for t in ("trial-0000", "trial-0002"):  # the others train on as if nothing happened
        assert _metrics(pruned / t) == _metrics(plain / t)
        assert [r["step"] for r in _metrics(pruned / t)] == [2, 4, 6]


def test_a_masked_row_of_a_stacked_state_stops_changing():
    cfg = experiment.load_config(f"{REPO / 'experiments' / 'char_lm.py'}:tiny", [])
    trainer = __import__("attnlab.train", fromlist=["Trainer"]).Trainer(cfg, kind="lm")
    state = jax.tree.map(lambda *xs: jnp.stack(xs), trainer.init_state(), trainer.init_state())
    task = __import__("attnlab.data", fromlist=["make_task"]).make_task(cfg.data)
    batch = task.train_batch(0, 0, int(cfg.train.batch_size))
    batch = jax.tree.map(lambda x: np.stack([x, x]), batch)
    runs.mask_row(state["opt_state"], 1)
    before = jax.device_get(state["params"])
    state, _ = trainer.stacked_train_step(state, batch)
    after = jax.device_get(state["params"])
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a[0] != b[0]).any()), before, after))
    kept = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a[1] == b[1]).all()), before, after))
    assert any(changed) and all(kept)


@pytest.mark.slow  # two CLI processes with JAX start-up and compilation: ~1 minute
def test_a_killed_search_resumes_its_study_without_losing_or_repeating_a_trial(tmp_path):
    config = _experiment(tmp_path, num=4, stack=1)
    root = tmp_path / "study"
    args = ["sweep", "--config", config, *BASE, "--config.train.steps=6", "--workdir", str(root)]
    args += ["--no-progress"]
    proc = run_checks.cli_process(*args)
    deadline = time.time() + 240
    while time.time() < deadline:  # kill it inside trial 1, once it has a checkpoint
        if list((root / "trial-0001" / "checkpoints").glob("2")):
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    storage = f"sqlite:///{root / 'study.db'}"
    killed = optuna.load_study(study_name="study", storage=storage).trials
    assert [t.state.name for t in killed][:2] == ["COMPLETE", "RUNNING"]
    cmd = [sys.executable, "-m", "attnlab.cli", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resuming trial(s) 1" in out.stdout
    trials = optuna.load_study(study_name="study", storage=storage).trials
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert trials[1].params == killed[1].params
    for t in trials:
        steps = [r["step"] for r in _metrics(root / t.user_attrs["dir"])]
        assert steps == [2, 4, 6]  # no record lost or logged twice
