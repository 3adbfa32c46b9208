"""A run's batches do not depend on how many processes or devices read them.

Every step reads one global batch, fixed by the seed and the step; process ``i`` of ``n``
keeps its block of rows (``grain_pipeline.process_rows``), the rows its devices hold. So one
process on one device and 2 processes x 4 devices train on the same batches, and a run
resumed with another process count continues the same order. The reference is the run on
one device in this process.
"""

import pathlib
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import xla_flags
from run_checks import TINY, losses

from attnlab import experiment, runs
from attnlab.data import grain_pipeline as gp
from attnlab.data import make_task
from attnlab.runs.checkpoint import Checkpointer

REPO = pathlib.Path(__file__).resolve().parents[1]
OVERRIDES = [
    "--config.train.steps=6",
    "--config.train.batch_size=8",
    "--config.checkpoint.every_steps=3",
    "--config.eval.batches=0",
    "--config.eval.sample_tokens=0",
    "--config.track.tensorboard=False",
]


def devices_rows(batch: int, devices: int, processes: int) -> list[list[int]]:
    """Each process's rows, counted out device by device: the batch split evenly over the
    devices in order, each process holding the next ``devices / processes`` of them."""
    per_device = np.array_split(np.arange(batch), devices)
    mine = devices // processes
    return [
        sorted(int(r) for d in per_device[p * mine : (p + 1) * mine] for r in d)
        for p in range(processes)
    ]


@pytest.mark.parametrize("batch,devices,processes", [(8, 8, 2), (8, 8, 1), (12, 4, 4), (16, 8, 4)])
def test_each_process_reads_the_rows_its_devices_hold(batch, devices, processes):
    want = devices_rows(batch, devices, processes)
    got = [gp.process_rows(batch, (p, processes)) for p in range(processes)]
    assert [list(range(batch))[s] for s in got] == want
    with pytest.raises(ValueError, match="train.batch_size=8"):
        gp.process_rows(8, (0, 3))


def test_the_processes_rows_make_the_one_process_batch(tmp_path):
    """Packed documents (several per row) and windows read by index: the rows of 1, 2 and
    4 processes put together are the one process's batch, at every step."""
    from attnlab.data.prepared import prepare

    for i in range(60):  # one short document per file
        (tmp_path / f"{i:02d}.txt").write_text(f"doc {i}: " + "word " * (i % 7) + "\n")
    prepare([str(tmp_path / "*.txt")], tmp_path / "p", tokenizer="byte", progress=False)
    for pipeline in ("grain", "index"):
        cfg = {"kind": "prepared", "path": str(tmp_path / "p"), "seq_len": 24}
        cfg["pipeline"] = pipeline
        one = make_task(cfg)
        want = [one.train_batch(5, step, 8) for step in range(4)]
        for n in (2, 4):
            parts = [make_task(cfg, host=(i, n)) for i in range(n)]
            for step in range(4):
                got = [p.train_batch(5, step, 8) for p in parts]
                for key, value in want[step].items():
                    joined = np.concatenate([g[key] for g in got])
                    np.testing.assert_array_equal(joined, value, err_msg=f"{pipeline} {key}")
        if pipeline == "grain":  # a packed row holds several documents
            assert (want[0]["segment_ids"].max(axis=1) > 1).any()


@pytest.mark.slow(reason="two training processes of 4 CPU devices each compile the sharded step")
def test_two_processes_of_four_devices_train_on_one_devices_batches(tmp_path):
    config = TINY
    runs.train(experiment.load_config(config, OVERRIDES), tmp_path / "one", progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        __import__("os").environ,
        XLA_FLAGS=xla_flags.devices(4),
        ATTNLAB_CPU_DEVICES="4",
        JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        PYTHONPATH=str(REPO),
    )
    cmd = [sys.executable, "-m", "attnlab.cli", "train", "--config", config, "--no-progress"]
    cmd += ["--workdir", str(tmp_path / "two"), *OVERRIDES]
    cmd += [f"--config.distributed.coordinator_address=127.0.0.1:{port}"]
    cmd += ["--config.distributed.num_processes=2"]
    procs = [
        subprocess.Popen(
            [*cmd, f"--config.distributed.process_id={i}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    assert "devices: 8 x cpu (cpu), 2 process(es)" in outs[0], outs[0][-2000:]
    want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    steps = sorted(want)
    # sums over 8 devices against one device's: float32 rounding only
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-4)

    # The 2-process run's step 3 resumed by one process continues the same batches, from
    # the pipeline's saved position (the same on every process), not a replay.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    with Checkpointer(resumed / "checkpoints") as ckpt:
        assert ckpt.restore_metadata(3)["data_state"]["step"] == 3
    cfg = experiment.load_config(config, OVERRIDES)
    runs.train(cfg, resumed, progress=False, step=3)
    again = losses(resumed)
    assert sorted(again) == steps
    np.testing.assert_allclose([again[s] for s in steps], [want[s] for s in steps], rtol=1e-4)
