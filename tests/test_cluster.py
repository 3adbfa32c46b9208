"""The cluster tier (``pytest -m cluster``): a real SLURM cluster, a PostgreSQL study and
processes that die.

``bash .ci/cluster start`` starts a one-node SLURM cluster and a PostgreSQL server on the
loopback address; the tests read where from ``$ATTNLAB_CLUSTER_DIR`` (default
``/tmp/attnlab-cluster``) and skip, saying why, where either does not answer. Every run is
the tiny character model of ``tests/cluster_experiment.py``; the reference of each is the
same run trained without interruption in one process on one CPU device.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import run_checks
import xla_flags

from attnlab import experiment, runs

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENT = str(REPO / "tests" / "cluster_experiment.py")
CLUSTER_DIR = pathlib.Path(os.environ.get("ATTNLAB_CLUSTER_DIR", "/tmp/attnlab-cluster"))
START = "bash .ci/cluster start"
pytestmark = pytest.mark.cluster


def cluster_env() -> dict:
    """The variables of ``$ATTNLAB_CLUSTER_DIR/env`` (SLURM_CONF, ATTNLAB_TEST_POSTGRES)."""
    path = CLUSTER_DIR / "env"
    found = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            found[key.strip()] = value.strip()
    return found


def child_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), **cluster_env(), **extra)
    env.pop("ATTNLAB_MESH_CHILD", None)
    return env


@pytest.fixture(scope="module")
def slurm():
    """The environment of the SLURM commands; skips where the cluster does not answer."""
    env = child_env()
    if shutil.which("sbatch") is None or not env.get("SLURM_CONF"):
        pytest.skip(
            f"no SLURM cluster: SLURM is not installed or {CLUSTER_DIR}/env is absent; {START}"
        )
    try:
        ping = subprocess.run(
            ["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        ping = subprocess.CompletedProcess([], 1, "", "no answer in 30 s")
    if "UP" not in ping.stdout:
        pytest.skip(
            f"slurmctld does not answer (scontrol ping: {ping.stdout or ping.stderr}); {START}"
        )
    return env


@pytest.fixture(scope="module")
def postgres():
    """The study database's URL; skips where PostgreSQL does not answer."""
    url = os.environ.get("ATTNLAB_TEST_POSTGRES") or cluster_env().get("ATTNLAB_TEST_POSTGRES")
    if not url:
        pytest.skip(
            f"no PostgreSQL: ATTNLAB_TEST_POSTGRES is unset and {CLUSTER_DIR}/env absent; {START}"
        )
    psycopg2 = pytest.importorskip("psycopg2", reason="the PostgreSQL driver: attnlab[postgres]")
    try:
        psycopg2.connect(url, connect_timeout=5).close()
    except psycopg2.OperationalError as e:
        pytest.skip(f"PostgreSQL at {url} does not answer ({str(e).strip()}); {START}")
    return url


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The ``long`` run (learning rate 1e-3), uninterrupted, one process, one device."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    cfg = experiment.load_config(f"{EXPERIMENT}:long", [])
    runs.train(cfg, workdir, progress=False)
    return workdir


def records(workdir) -> dict:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r for r in rows}


def assert_same_losses(got_dir, want_dir, rtol, steps=None):
    got, want = records(got_dir), records(want_dir)
    steps = sorted(want) if steps is None else steps
    assert set(steps) <= set(got), (sorted(got), steps)
    for key in ("train_loss", "eval_loss"):
        pairs = [(got[s][key], want[s][key]) for s in steps if key in want[s]]
        np.testing.assert_allclose(*zip(*pairs, strict=True), rtol=rtol, err_msg=key)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_sweep_job_array_reports_its_jobs_and_a_preempted_trial_is_requeued(
    slurm, reference, tmp_path
):
    """``--launcher slurm``: four trials in one job array; the first is sent SIGTERM mid-run
    (``scancel --signal=TERM``), checkpoints, is requeued and ends equal to the reference."""
    from attnlab.runs.checkpoint import Checkpointer
    from attnlab.sweep import load_sweep

    root = tmp_path / "sweep"
    names = [t.name for t in load_sweep(f"{EXPERIMENT}:long").trials]
    first = root / names[0]
    cmd = [sys.executable, "-m", "attnlab.cli", "sweep", "--config", f"{EXPERIMENT}:long"]
    proc = subprocess.Popen(
        [*cmd, "--workdir", str(root), "--launcher", "slurm", "--no-progress"],
        cwd=REPO,
        env=slurm,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: max(records(first), default=0) >= 10, 240, "the first trial's step 10")
        job = json.loads((first / "job.json").read_text())["job_id"]
        subprocess.run(["scancel", "--signal=TERM", job], env=slurm, check=True, timeout=30)
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    said = {
        n: [ln.split(": ")[1].split()[0] for ln in out.splitlines() if ln.startswith(n + ": ")]
        for n in names
    }
    for name in names:
        assert said[name][-1] == "finished" and "running" in said[name], out
    # requeued: running, then queued again, then running to the end
    words = said[names[0]]
    assert words.index("running") < len(words) - 1 - words[::-1].index("queued"), out
    assert json.loads((first / "job.json").read_text())["restarts"] == 1
    with Checkpointer(first / "checkpoints") as ckpt:
        stops = [ckpt.restore_metadata(s).get("interrupted") for s in ckpt.all_steps()]
    assert "SIGTERM" in stops
    assert sorted(records(first)) == sorted(records(reference))  # each step logged once
    assert_same_losses(first, reference, rtol=1e-6)
    results = json.loads((root / "results.json").read_text())
    assert sorted(r["status"] for r in results["trials"]) == ["finished"] * 4


def test_a_two_task_srun_job_trains_through_jax_distributed_like_one_device(
    slurm, reference, tmp_path
):
    """``srun -n 2``, 2 CPU devices per task: jax.distributed initialised from SLURM's
    variables, one 4-device data mesh, the losses of one device."""
    env = dict(slurm, XLA_FLAGS=xla_flags.devices(2), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    train = [sys.executable, "-m", "attnlab.cli", "train", "--config", f"{EXPERIMENT}:long"]
    srun = ["srun", "-n", "2", "--cpus-per-task=1", *train, "--workdir", str(tmp_path / "two")]
    out = run_checks.run_to_success([*srun, "--no-progress"], env)
    assert "devices: 4 x cpu (cpu), 2 process(es)" in out.stdout, out.stdout[-2000:]
    assert_same_losses(tmp_path / "two", reference, rtol=1e-4)  # 120 steps over 4 devices


def test_a_partition_that_does_not_exist_is_one_line(slurm, tmp_path):
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", "sweep", "--config", EXPERIMENT, "--workdir"]
        + [str(tmp_path), "--launcher", "slurm", "--partition", "nowhere"],
        cwd=REPO,
        env=slurm,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and time.monotonic() - t0 < 60
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--partition='nowhere'" in lines[0] and "debug" in lines[0], lines


def test_a_postgresql_study_survives_a_worker_killed_mid_trial(postgres, tmp_path):
    """Three workers share one study; one is SIGKILLed while it trains; its trials fail on
    their stale heartbeat, are retried from their checkpoints, and the study ends with
    exactly ``num_trials`` complete trials, none counted twice."""
    import optuna

    from attnlab.sweep import load_sweep
    from attnlab.sweep.search import make_storage

    study = f"cluster-{uuid.uuid4().hex[:8]}"
    root = tmp_path / "search"
    cmd = [sys.executable, "-m", "attnlab.cli", "sweep", "--config", f"{EXPERIMENT}:search"]
    cmd += ["--workdir", str(root), "--storage", postgres, "--study-name", study, "--no-progress"]
    logs = [tmp_path / f"worker{i}.log" for i in range(3)]
    workers = []
    for log in logs:
        with log.open("w") as f:
            workers.append(
                subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
            )
    try:

        def training_past_a_checkpoint():
            for i, log in enumerate(logs):
                text = log.read_text()
                for line in text.splitlines():
                    if line.startswith("search: training "):
                        dirs = line.removeprefix("search: training ").split(" (")[0].split(", ")
                        if all(max(records(root / d), default=0) >= 30 for d in dirs):
                            return i
            return None

        def ready():
            assert any(w.poll() is None for w in workers), [log.read_text() for log in logs]
            return training_past_a_checkpoint() is not None

        wait_for(ready, 240, "a worker at step 30")
        victim = training_past_a_checkpoint()
        workers[victim].send_signal(signal.SIGKILL)
        for i, w in enumerate(workers):
            if i != victim:
                w.wait(timeout=240)
    finally:
        for w in workers:
            w.kill()
    outs = [log.read_text() for log in logs]
    survivors = [i for i in range(3) if i != victim]
    for i in survivors:
        assert workers[i].returncode == 0, outs[i][-3000:]
    search = load_sweep(f"{EXPERIMENT}:search").search
    trials = optuna.load_study(study_name=study, storage=make_storage(postgres, search)).trials
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(complete) == 4
    assert len({t.user_attrs["dir"] for t in complete}) == 4  # none counted twice
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", ())}
    dead = [t.number for t in failed if not t.user_attrs.get("surplus")]
    assert dead and set(dead) <= retried  # asked again, from their checkpoints
    assert any("resuming from step 20" in outs[i] for i in survivors)  # from its checkpoint
    assert any("(vmap)" in outs[i] for i in range(3))  # stacked trials still stack
    rows = json.loads((root / "results.json").read_text())["trials"]
    assert sorted(r["status"] for r in rows) == ["finished"] * 4


def test_four_processes_stop_in_one_line_when_one_is_killed_and_resume_on_two(reference, tmp_path):
    """4 processes x 2 CPU devices; process 2 is SIGKILLed after a checkpoint; the others
    stop within a bounded time, each with one line naming it; 2 processes x 4 devices
    resume and train as one uninterrupted device does."""
    train = [sys.executable, "-m", "attnlab.cli", "train", "--config", f"{EXPERIMENT}:long"]
    train += ["--workdir", str(tmp_path / "run"), "--no-progress"]
    train += ["--config.checkpoint.every_steps=20"]

    def start(n, devices):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = child_env(XLA_FLAGS=xla_flags.devices(devices))
        env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
        flags = [f"--config.distributed.coordinator_address=127.0.0.1:{port}"]
        flags += [
            f"--config.distributed.num_processes={n}",
            "--config.distributed.heartbeat_timeout_s=10",
        ]
        return [
            subprocess.Popen(
                [*train, *flags, f"--config.distributed.process_id={i}"],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(n)
        ]

    four = start(4, 2)
    try:
        ckpts = tmp_path / "run" / "checkpoints"
        wait_for(
            lambda: ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()),
            240,
            "a checkpoint",
        )
        four[2].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        outs = [p.communicate(timeout=120) for p in four]
        took = time.monotonic() - killed
    finally:
        for p in four:
            p.kill()
    assert took < 60, took
    report = "\n".join(f"process {i}: exit {p.returncode}, stderr ends:\n{outs[i][1][-1500:]}"
                       for i, p in enumerate(four))  # fmt: skip
    lines = {i: [ln for ln in outs[i][1].splitlines() if "stopped answering" in ln]
             for i in (0, 1, 3)}  # fmt: skip
    # A survivor may go silent too: gloo aborts a collective's peer of the killed process
    # (std::terminate on gloo::EnforceNotMet, SIGABRT) before its watchdog can speak. Each
    # survivor that answered prints one line naming process 2 and, beside it, only
    # survivors that aborted.
    silent = {i for i, found in lines.items() if not found}
    aborted = {i for i in (0, 1, 3) if four[i].returncode == -signal.SIGABRT}
    assert silent <= aborted, report
    for i in set(lines) - silent:
        assert four[i].returncode == 1 and len(lines[i]) == 1, report
        named = re.search(r"process(?:es)? ([\d, ]+) of 4 stopped answering", lines[i][0])
        who = {int(n) for n in named.group(1).split(", ")}
        assert 2 in who and who - {2} <= silent, report
        assert "Check failure stack trace" not in outs[i][1]
    saved = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert 0 < saved < 120
    two = start(2, 4)
    try:
        done = [p.communicate(timeout=300) for p in two]
    finally:
        for p in two:
            p.kill()
    for p, (out, err) in zip(two, done, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-2000:]
    assert f"resuming from step {saved}" in done[0][0]
    assert "resuming on 8 devices in 2 processes" in done[0][0], done[0][0][-2000:]
    # 120 steps of sums split over 8 devices against one device's: float32 rounding drifts
    after = [s for s in records(reference) if s > saved]
    assert_same_losses(tmp_path / "run", reference, rtol=1e-4, steps=after)
    if silent == set(lines):  # the run resumed, but no survivor could say why it stopped
        pytest.xfail(f"gloo aborted every survivor before its watchdog spoke:\n{report}")
