"""Beyond one machine, bad input is one line within a bounded time: a study database that
does not answer, a SLURM partition the cluster does not have (or a controller that does not
answer), a coordinator address where no process 0 listens."""

import os
import pathlib
import socket
import stat
import time

import pytest

from attnlab import cli
from attnlab.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENT = str(REPO / "tests" / "cluster_experiment.py")


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line_error(capsys, argv, code=2, within_s=20.0) -> str:
    t0 = time.monotonic()
    assert cli.main(argv) == code
    took = time.monotonic() - t0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert took < within_s, took
    return lines[0]


@pytest.mark.slow(reason="imports Optuna, SQLAlchemy and the PostgreSQL driver: seconds")
def test_an_unreachable_study_database_is_one_line_without_its_password(capsys, tmp_path):
    url = f"postgresql://someone:secret@127.0.0.1:{closed_port()}/study"
    line = one_line_error(
        capsys,
        ["sweep", "--config", f"{EXPERIMENT}:search", "--workdir", str(tmp_path), "--storage", url],
    )
    assert line.startswith("attnlab sweep: error: --storage postgresql://someone:***@127.0.0.1")
    assert "secret" not in line
    assert "cannot be reached" in line or "no database driver" in line


def test_a_coordinator_that_never_answers_is_one_line(capsys, tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    line = one_line_error(
        capsys,
        ["train", "--config", EXPERIMENT, "--workdir", str(tmp_path / "run")]
        + [f"--config.distributed.coordinator_address={address}"]
        + ["--config.distributed.num_processes=2", "--config.distributed.process_id=1"]
        + ["--config.distributed.initialization_timeout_s=1"],
    )
    assert f"distributed.coordinator_address={address}: no coordinator answered within 1 s" in line
    assert not (tmp_path / "run").exists()


def fake_command(folder: pathlib.Path, name: str, script: str):
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_partition_the_cluster_lacks_is_refused_before_submitting(tmp_path, monkeypatch):
    from attnlab.sweep import slurm

    fake_command(tmp_path, "sinfo", 'printf "debug\\ngpu\\ndebug\\n"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    slurm.check_partition("gpu")
    slurm.check_partition(None)
    with pytest.raises(ConfigError, match=r"--partition='nowhere'.*\['debug', 'gpu'\]"):
        slurm.check_partition("nowhere")


def test_a_slurm_controller_that_does_not_answer_is_one_line(tmp_path, monkeypatch):
    from attnlab.sweep import slurm

    fake_command(tmp_path, "sinfo", "sleep 30")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(slurm, "TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="got no answer in 0.5 s") as e:
        slurm.check_partition("debug")
    assert time.monotonic() - t0 < 5 and "\n" not in str(e.value)


def test_slurm_states_read_as_four_words():
    from attnlab.sweep.slurm import word

    assert [word(s) for s in ("PENDING", "REQUEUED", "RUNNING", "COMPLETING")] == [
        "queued",
        "queued",
        "running",
        "running",
    ]
    assert [word(s) for s in ("COMPLETED", "FAILED", "CANCELLED by 0", "TIMEOUT")] == [
        "finished",
        "failed",
        "failed",
        "failed",
    ]
