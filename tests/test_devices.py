"""One CPU device per core for `attnlab train`: when it is chosen, and that a run on it
trains like a run on one device."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from attnlab import devices, experiment
from attnlab.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = "experiments/shakespeare_char.py:tiny"


def cfg(*overrides):
    return experiment.load_config(str(REPO / TINY), list(overrides))


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(devices.cpu, "cores", lambda: 4)
    monkeypatch.delenv(devices.ENV, raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)


def test_auto_takes_one_device_per_core_where_the_batches_divide(four_cores):
    # tiny: train and eval batches of 4
    assert devices.choose(cfg()) == 4
    # the largest count that divides both the micro-batch and the eval batch
    assert devices.choose(cfg("--config.train.batch_size=6", "--config.eval.batch_size=6")) == 3
    assert devices.choose(cfg("--config.eval.batch_size=2")) == 2
    assert devices.choose(cfg("--config.train.batch_size=7", "--config.eval.batch_size=7")) == 1
    # gradient accumulation splits the batch first: 12 / 3 = 4 per micro-step
    accum = ("--config.train.batch_size=12", "--config.optim.grad_accum_steps=3")
    assert devices.choose(cfg(*accum)) == 4
    accum = ("--config.train.batch_size=12", "--config.optim.grad_accum_steps=4")
    assert devices.choose(cfg(*accum)) == 1  # 3 rows per micro-step, eval batch 4


def test_auto_leaves_explicit_meshes_and_multi_host_runs_alone(four_cores, monkeypatch):
    assert devices.choose(cfg("--config.mesh.fsdp=2")) == 1
    assert devices.choose(cfg("--config.mesh.data=2")) == 1
    assert devices.choose(cfg("--config.distributed.coordinator_address=host:1234")) == 1
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert devices.choose(cfg()) == 1


def test_the_variable_chooses_and_a_bad_value_names_it(four_cores, monkeypatch):
    assert devices.choose(cfg(), "off") == 1
    assert devices.choose(cfg(), "1") == 1
    assert devices.choose(cfg(), "3") == 3
    monkeypatch.setenv(devices.ENV, "2")
    assert devices.choose(cfg()) == 2
    for bad in ("two", "0", "-1"):
        with pytest.raises(ConfigError, match=devices.ENV):
            devices.choose(cfg(), bad)


def test_apply_does_nothing_once_jax_runs():
    import jax

    jax.devices()  # the backends of this process are up
    before = os.environ.get("XLA_FLAGS")
    assert devices.apply(2) is False
    assert os.environ.get("XLA_FLAGS") == before


def test_apply_in_a_fresh_process_gives_single_threaded_devices():
    code = (
        "import os, jax; from attnlab import devices; "
        "print(devices.apply(2), len(jax.devices()), os.environ['XLA_FLAGS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    assert out == ["True", "2", "--xla_cpu_multi_thread_eigen=false"]


def _text(tmp_path):
    """A corpus the test writes itself (the experiment's own text lives in the user's cache)."""
    path = tmp_path / "text.txt"
    if not path.exists():
        words = ["the", "king", "shall", "speak", "of", "night", "and", "we", "hear", "it"]
        rng = np.random.default_rng(0)
        lines = (" ".join(rng.choice(words, 9)) + ".\n" for _ in range(1500))
        path.write_text("".join(lines), encoding="utf-8")
    return path


def _train(tmp_path, name, setting):
    workdir = tmp_path / name
    cmd = [sys.executable, "-m", "attnlab.cli", "train", "--config", str(REPO / TINY)]
    cmd += [f"--config.data.path={_text(tmp_path)}"]
    cmd += ["--workdir", str(workdir), "--no-progress", "--config.train.steps=4"]
    cmd += ["--config.eval.every_steps=4", "--config.checkpoint.every_steps=4"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({devices.ENV: setting, "ATTNLAB_COMPILATION_CACHE": "off"})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout + proc.stderr, rows


@pytest.mark.slow(reason="trains the tiny run in two fresh processes, on one and two devices")
def test_a_run_on_two_cpu_devices_trains_like_one_on_one(tmp_path):
    out2, rows2 = _train(tmp_path, "two", "2")
    out1, rows1 = _train(tmp_path, "one", "1")
    assert "devices: 2 x cpu" in out2 and "one per core" in out2
    assert "devices:" not in out1  # the header names devices only when there are several
    keys = ("train_loss", "eval_loss", "grad_norm")
    pairs = [(a[k], b[k]) for a, b in zip(rows1, rows2, strict=True) for k in keys if k in a]
    assert len(pairs) >= 4
    for a, b in pairs:
        assert b == pytest.approx(a, rel=2e-5, abs=1e-6)


_MANY_STEPS = """
import sys
import jax
import numpy as np
from attnlab import devices, experiment, train
from attnlab.devices import sharding

assert devices.apply(2)
short = ["--config.data.seq_len=16", "--config.model.max_len=16"]
cfg = experiment.load_config(sys.argv[1], ["--config.train.batch_size=4", *short])
trainer = train.Trainer(cfg, kind="lm", mesh=sharding.make_mesh({"data": 2}))
state = trainer.init_state()
rng = np.random.default_rng(0)
T = int(cfg.data.seq_len)
batches = [
    {"inputs": rng.integers(0, 65, (4, T), dtype=np.int32),
     "targets": rng.integers(0, 65, (4, T), dtype=np.int32),
     "loss_mask": np.ones((4, T), np.float32)}
    for _ in range(8)
]
for i in range(400):  # never reads a result: steps are dispatched as fast as they can be
    state, metrics = trainer.train_step(state, batches[i % 8])
batches = batches * 20
two = trainer.evaluate(state["params"], batches)["eval_loss"]
params = jax.device_get(state["params"])
print(two, train.Trainer(cfg, kind="lm").evaluate(params, batches)["eval_loss"])
"""


@pytest.mark.slow(
    reason="a fresh process on two CPU devices dispatches steps until they would hang"
)
def test_steps_dispatched_without_reading_results_do_not_hang_on_two_cpu_devices():
    """A loop that dispatches 400 steps of the 4 x 128 model (rows of 16 tokens: short steps
    queue up fastest) without reading a result (a notebook's loop over prepared batches)
    hung in a collective on 2 single-threaded CPU devices until XLA's rendezvous gave up
    after 40 s. The steps now run one program at a
    time; the evaluation of the result (160 batches, dispatched the same way) equals one
    device's."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", _MANY_STEPS, str(REPO / "experiments/shakespeare_char.py")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    two, one = map(float, proc.stdout.split()[-2:])
    assert np.isfinite(two) and two == pytest.approx(one, rel=1e-5)
