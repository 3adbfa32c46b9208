"""The XLA flags of the test sessions and of the processes they start.

The tests' programs are tiny, so compiling them is most of the suite's time. Besides XLA's
backend optimisations (off through ``JAX_DISABLE_MOST_OPTIMIZATIONS``, ``conftest.py``), the
CPU backend's MLIR fusion emitters cost more to compile than its older elemental emitters:
without them (``--xla_cpu_use_fusion_emitters=false``) the tiny model's train and eval steps
took 0.5-0.9 s of CPU to compile instead of 2.7 s, and tests/test_models.py 41 s of CPU
instead of 60 s, every test passing unchanged. With the backend optimisations on, the same
flag made that compile ten times slower, so the two go together and neither reaches the
library or the CLI.
"""

import os
import pathlib

import pytest

COMPILE = "--xla_cpu_use_fusion_emitters=false"
# This process is the child ``run_on_devices`` starts (its mesh tests run here).
CHILD = os.environ.get("ATTNLAB_MESH_CHILD") == "1"
on_mesh = pytest.mark.skipif(not CHILD, reason="runs in run_on_devices' child on 8 CPU devices")


def session() -> str:
    """This process's ``XLA_FLAGS``: what the environment gives (one CPU device by
    default) plus ``COMPILE``."""
    flags = os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    return flags if COMPILE in flags else f"{flags} {COMPILE}"


def devices(n: int) -> str:
    """``XLA_FLAGS`` for a child process on ``n`` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={n} {COMPILE}"


def run_on_devices(test_file: str, *pytest_args: str, n: int = 8, timeout: int = 900):
    """Runs ``test_file`` in a child pytest process on ``n`` fake CPU devices, with
    ``ATTNLAB_MESH_CHILD=1`` so that its mesh tests run there (they skip in the parent),
    ``pytest_args`` added to the child's command line, and
    fails with the end of the child's output unless every selected test passed. In the child
    itself it skips (the test that calls it may be selected there too)."""
    import subprocess
    import sys

    if CHILD:
        pytest.skip("this is the child process")

    tests = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ, ATTNLAB_MESH_CHILD="1", XLA_FLAGS=devices(n))
    env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests)])
    # One process: the parent session's workers already fill the cores.
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0"]
    out = subprocess.run(
        [*argv, *pytest_args, test_file],
        cwd=tests.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "failed" not in out.stdout.splitlines()[-1]
