"""A run resumes on another mesh, device count or process count, and opens on any device count.

The mesh decides where the values live, never what they are: a resumed run may change it
without ``--allow-changes`` and says what changed in one line, and ``load_run`` (``attnlab
eval``/``sample``) opens a run saved on one device count in a process with another. The
reference is the same run trained without a stop on one device.
"""

import json
import os
import pathlib
import sys
import textwrap

import numpy as np
import pytest
import run_checks
import xla_flags
from run_checks import losses

from attnlab import experiment, runs
from attnlab.runs import workdir as workdir_mod

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny(*overrides):
    base = [
        "--config.train.steps=4",
        "--config.checkpoint.every_steps=1",
        "--config.eval.every_steps=4",
        "--config.eval.sample_tokens=0",
        "--config.track.tensorboard=False",
        *overrides,
    ]
    return run_checks.tiny(*base)


def test_a_mesh_change_is_no_config_change(tmp_path):
    cfg = tiny()
    (tmp_path / "config.json").write_text(experiment.to_json(cfg))
    moved = tiny("--config.mesh.data=2", "--config.mesh.tensor=4")
    assert workdir_mod.check_config(tmp_path, moved, allow_changes=False) == []
    changed = tiny("--config.optim.learning_rate=0.5")
    with pytest.raises(experiment.ExperimentError, match="optim.learning_rate"):
        workdir_mod.check_config(tmp_path, changed, allow_changes=False)


CHILD = """
import contextlib, io, json, sys
from attnlab import cli
run, cfg = sys.argv[1], sys.argv[1] + "/config.json"
for argv in (["eval", "--workdir", run], ["sample", "--workdir", run, "--max-new-tokens", "4"],
             ["train", "--config", cfg, "--workdir", run, "--no-progress",
              "--config.mesh.data=4", "--config.mesh.tensor=2"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    print(json.dumps({"argv": argv[0], "code": code, "out": out.getvalue()}), flush=True)
"""


@pytest.mark.slow(reason="a child process on 8 CPU devices compiles the sharded programs")
def test_a_run_saved_on_one_device_opens_and_resumes_on_eight(tmp_path):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    runs.train(tiny(), whole, progress=False)
    runs.train(tiny(), stopped, progress=False, stop_after=2)
    want_eval = runs.evaluate(stopped, 2)["eval_loss"]
    env = dict(os.environ, XLA_FLAGS=xla_flags.devices(8), PYTHONPATH=str(REPO))
    env["ATTNLAB_CPU_DEVICES"] = "1"
    out = run_checks.run_to_success(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(stopped)], env
    )
    done = {r["argv"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert {r["code"] for r in done.values()} == {0}, done
    # batch_size=4 does not split over 8 devices: the run opens on a mesh that splits it
    got_eval = json.loads(done["eval"]["out"].splitlines()[-1])
    assert got_eval["step"] == 2
    np.testing.assert_allclose(got_eval["eval_loss"], want_eval, rtol=1e-5)
    assert done["sample"]["out"].strip()
    # the resumed run trains on the new mesh without --allow-changes and says so
    said = done["train"]["out"]
    assert (
        "resuming on 8 devices in 1 process, mesh data=4 x tensor=2 "
        "(saved on 1 device in 1 process, mesh none)"
    ) in said, said
    got, want = losses(stopped), losses(whole)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in (3, 4)], [want[s] for s in (3, 4)], rtol=1e-5)
