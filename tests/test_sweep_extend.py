"""Extending a sweep: more steps, more seeds, new grid points; refusals before training."""

import contextlib
import io
import json
import pathlib

import jax
import numpy as np
import pytest

from attnlab import cli, experiment, runs, sweep
from attnlab.experiment import ExperimentError
from attnlab.train import lr_multiplier

REPO = pathlib.Path(__file__).resolve().parents[1]
CHAR_LM = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
COMMON = [
    "--config.train.log_every_steps=1",
    "--config.eval.every_steps=4",
    "--config.eval.sample_tokens=0",
    "--config.checkpoint.every_steps=4",
    "--config.optim.warmup_steps=2",
]


def _quiet(*_):
    pass


def _losses(d):
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in rows}


def _plan(steps, seeds, schedule="constant", spec=None):
    flags = [*COMMON, f"--config.train.steps={steps}", f"--config.optim.schedule={schedule}"]
    return sweep.plan_sweep(CHAR_LM, flags, spec or sweep.grid({"train.seed": seeds}))


def test_wsd_holds_the_peak_and_decays_over_the_last_fraction():
    o = experiment.base_config().optim
    o.update(schedule="wsd", warmup_steps=2, decay_fraction=0.25, min_lr_ratio=0.0)
    lr8, lr16 = lr_multiplier(o, 8), lr_multiplier(o, 16)
    at = [float(lr8(s)) for s in range(8)]
    assert at[:2] == [0.5, 1.0] and at[2:6] == [1.0] * 4  # warmup, stable until step 6
    assert at[6] == 1.0 and 0 < at[7] < 1.0
    assert [float(lr16(s)) for s in range(12)] == at[:2] + [1.0] * 10  # decay moved by total


def _fake_trial(root, steps, schedule, ckpts, status="finished"):
    cfg = experiment.load_config(CHAR_LM, [f"--config.train.steps={steps}"])
    cfg.optim.schedule = schedule
    d = root / "t"
    (d / "checkpoints").mkdir(parents=True)
    for s in ckpts:
        (d / "checkpoints" / str(s)).mkdir()
    (d / "config.json").write_text(experiment.to_json(cfg))
    (d / "status.json").write_text(json.dumps({"status": status}))
    return d, cfg


def test_an_action_per_trial_decided_before_training(tmp_path):
    d, cfg = _fake_trial(tmp_path / "a", 100, "wsd", [80, 90, 100])
    more = experiment.load_config(CHAR_LM, ["--config.train.steps=200"])
    more.optim.schedule = "wsd"
    trial = sweep.Trial("t", {}, more)
    action = sweep.trial_action(trial, d)
    assert (action.kind, action.step) == ("extend", 90)  # the newest before the decay at 90
    assert sweep.trial_action(sweep.Trial("t", {}, cfg), d).kind == "skip"
    d, cfg = _fake_trial(tmp_path / "b", 100, "cosine", [100])
    more.optim.schedule = "cosine"
    with pytest.raises(ExperimentError) as e:
        sweep.trial_action(sweep.Trial("t", {}, more), d)
    message = str(e.value)
    assert "\n" not in message and "'cosine'" in message
    assert "--allow-changes" in message and "wsd" in message
    allowed = sweep.trial_action(sweep.Trial("t", {}, more), d, allow_changes=True)
    assert allowed.kind == "extend" and allowed.allow_changes
    fewer = experiment.load_config(CHAR_LM, ["--config.train.steps=50"])
    with pytest.raises(ExperimentError, match="fewer"):
        sweep.trial_action(sweep.Trial("t", {}, fewer), d, allow_changes=True)


def _cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cosine_sweep_given_more_steps_is_refused_and_relabels_nothing(tmp_path):
    root = tmp_path / "cos"
    exp = tmp_path / "exp.py"
    exp.write_text(
        (REPO / "experiments" / "char_lm.py").read_text()
        + "\n\ndef sweep(variant=None):\n    return [{'train.seed': 0}]\n"
    )
    argv = ["sweep", "--config", f"{exp}:tiny", "--workdir", str(root), "--no-progress"]
    code, out, _ = _cli([*argv, "--config.train.steps=2", "--config.eval.sample_tokens=0"])
    assert code == 0 and "sweep: 1 finished, 0 failed, 0 skipped, 0 pruned" in out
    before = {p: p.read_bytes() for p in root.rglob("*.json")}
    code, out, err = _cli([*argv, "--config.train.steps=4", "--config.eval.sample_tokens=0"])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "optim.schedule='cosine'" in err and "--allow-changes" in err
    assert {p: p.read_bytes() for p in root.rglob("*.json")} == before  # nothing relabelled


@pytest.mark.slow  # three stacked sweeps of a tiny model: ~45 s on 2 cores
def test_more_steps_continue_finished_trials_exactly_and_new_seeds_run_alone(tmp_path):
    root, scratch = tmp_path / "extended", tmp_path / "scratch"
    first = sweep.run_sweep(_plan(4, [0, 1]), root, log=_quiet)
    assert first["outcomes"]["finished"] == 2
    lines = []
    again = sweep.run_sweep(_plan(8, [0, 1, 2]), root, log=lines.append)
    assert again["outcomes"] == {
        "finished": 3,
        "failed": 0,
        "skipped": 0,
        "pruned": 0,
        "stopped": 0,
    }
    assert "extend train.seed=0 (4 -> 8 steps)" in lines
    sweep.run_sweep(_plan(8, [0, 1]), scratch, log=_quiet)
    for seed in (0, 1):
        name = f"train.seed={seed}"
        assert _losses(root / name) == _losses(scratch / name)
        a, b = runs.load_run(root / name), runs.load_run(scratch / name)
        assert a.step == b.step == 8
        same = jax.tree.map(lambda x, y: np.array_equal(x, y), a.params, b.params)
        assert all(jax.tree.leaves(same))  # bitwise
    # A new grid point on the finished sweep: only it trains; the others are not touched.
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("metrics.jsonl")}
    lines = []
    spec = sweep.grid({"train.seed": [0, 1, 2]}) + [{"train.seed": 3, "optim.b2": 0.95}]
    result = sweep.run_sweep(_plan(8, None, spec=spec), root, log=lines.append)
    assert result["outcomes"]["finished"] == 1 and result["outcomes"]["skipped"] == 3
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert [r["status"] for r in result["trials"]] == ["finished"] * 4
    assert lines[-1] == "sweep: 1 finished, 0 failed, 3 skipped, 0 pruned"
    # A cosine schedule continues only when asked to (the schedule stretched from there on).
    with pytest.raises(ExperimentError, match="cosine"):
        sweep.run_sweep(_plan(12, [0], "cosine"), tmp_path / "cos", log=_quiet) if (
            sweep.run_sweep(_plan(8, [0], "cosine"), tmp_path / "cos", log=_quiet)
        ) else None
    lines = []
    sweep.run_sweep(
        _plan(12, [0], "cosine"), tmp_path / "cos", log=lines.append, allow_changes=True
    )
    assert "extend train.seed=0 (8 -> 12 steps)" in lines
    assert runs.load_run(tmp_path / "cos" / "train.seed=0").step == 12
