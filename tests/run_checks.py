"""What the tests of runs and of the ``attnlab`` command share: the tiny ``char_lm`` experiment,
a run's metric records, bitwise-equal parameters, and the command as a call in this process, a
streamed child process or a child process run to its end."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"


def tiny(*overrides):
    """The tiny ``char_lm`` config with ``--config.`` overrides."""
    from attnlab import experiment

    return experiment.load_config(TINY, list(overrides))


def straight_and_stopped(root: pathlib.Path, *overrides, stop_after: int):
    """The tiny run trained to its end in ``root/straight`` and stopped after ``stop_after``
    steps in ``root/resumed`` (each from a freshly loaded config)."""
    from attnlab import runs

    runs.train(tiny(*overrides), root / "straight", progress=False)
    runs.train(tiny(*overrides), root / "resumed", progress=False, stop_after=stop_after)


def records(workdir: pathlib.Path) -> list[dict]:
    """Every row of a run's ``metrics.jsonl``."""
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def assert_same_params(a, b):
    """Two loaded runs' parameters are bitwise equal."""
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def call_cli(capsys, argv) -> tuple[int, str, str]:
    """``attnlab ARGV`` in this process: its exit code, argparse's usage errors included, and
    what it printed to stdout and stderr."""
    from attnlab.cli import main

    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def cli_process(*args) -> subprocess.Popen:
    """``attnlab ARGS`` as an unbuffered child process: stdout and stderr one text stream."""
    return subprocess.Popen(
        [sys.executable, "-m", "attnlab.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def run_to_success(cmd, env) -> subprocess.CompletedProcess:
    """``cmd`` run from the checkout within 5 minutes; it exits 0 (else the ends of its
    output say why)."""
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def losses(workdir: pathlib.Path) -> dict[int, float]:
    """A run's logged training loss by step."""
    return {r["step"]: r["train_loss"] for r in records(workdir) if "train_loss" in r}
