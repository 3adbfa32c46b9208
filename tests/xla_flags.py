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

COMPILE = "--xla_cpu_use_fusion_emitters=false"


def session() -> str:
    """This process's ``XLA_FLAGS``: what the environment gives (one CPU device by
    default) plus ``COMPILE``."""
    flags = os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    return flags if COMPILE in flags else f"{flags} {COMPILE}"


def devices(n: int) -> str:
    """``XLA_FLAGS`` for a child process on ``n`` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={n} {COMPILE}"
