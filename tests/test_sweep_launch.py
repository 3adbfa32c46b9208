"""Sweeps through submitit: the local executor runs each trial in its own process."""

import json
import os

import pytest
from conftest import REPO

from attnlab.sweep import plan_sweep, run_sweep

submitit = pytest.importorskip("submitit", reason="submitit launches the trials")

from attnlab.sweep.launch import JOB_FILE, launch_sweep  # noqa: E402

OVERRIDES = [
    "--config.train.steps=2",
    "--config.eval.every_steps=2",
    "--config.eval.sample_tokens=0",
    "--config.eval.batches=1",
    "--config.checkpoint.every_steps=2",
    "--config.track.tensorboard=False",
]


def _comparable(path):
    results = json.loads(path.read_text())
    for row in results["trials"]:
        row.pop("wall_sec")
    return results


@pytest.mark.slow(reason="starts a JAX process per trial")
def test_local_launcher_runs_each_trial_in_its_own_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the jobs import this checkout's attnlab
    spec = [{"train.seed": 0}, {"train.seed": 1}]
    plan = plan_sweep(f"{REPO / 'experiments' / 'char_lm.py'}:tiny", OVERRIDES, spec)
    run_sweep(plan, tmp_path / "inprocess", parallel="sequential", log=lambda *_: None)
    logs = []
    launch_sweep(plan, tmp_path / "local", launcher="local", log=logs.append)
    jobs = [json.loads((tmp_path / "local" / t.name / JOB_FILE).read_text()) for t in plan.trials]
    pids = {j["pid"] for j in jobs}
    assert len(pids) == 2 and os.getpid() not in pids
    assert _comparable(tmp_path / "local" / "results.json") == _comparable(
        tmp_path / "inprocess" / "results.json"
    )
    launch_sweep(plan, tmp_path / "local", launcher="local", log=logs.append)
    assert sum(line.startswith("skip ") for line in logs) == 2  # finished trials are skipped
