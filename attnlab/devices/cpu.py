"""The CPU device count of a run: ``cores``, ``choose`` and ``apply`` (``attnlab.devices``
says why one device per core). ``APPLIED`` says whether this process asked for them."""

from __future__ import annotations

import os

from attnlab.errors import ConfigError

ENV = "ATTNLAB_CPU_DEVICES"
APPLIED = False  # whether this process asked for one device per core
_SINGLE_THREADED = "--xla_cpu_multi_thread_eigen=false"


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose(cfg, setting: str | None = None) -> int:
    """The number of CPU devices for training ``cfg`` under ``setting`` (default: the
    ``ATTNLAB_CPU_DEVICES`` variable, else ``auto``)."""
    setting = str(os.environ.get(ENV, "auto") if setting is None else setting).strip().lower()
    if setting in ("off", "1"):
        return 1
    if setting != "auto":
        try:
            n = int(setting)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(
                f"{ENV}={setting!r}: use 'auto', 'off' or a positive number of CPU devices"
            )
        return n
    default_mesh = int(cfg.mesh.data) == -1 and all(
        int(cfg.mesh.get(a, 1)) == 1 for a in ("fsdp", "tensor", "context", "expert")
    )
    several_hosts = bool(cfg.distributed.coordinator_address) or (
        int(os.environ.get("SLURM_NTASKS", "1")) > 1
    )
    if not default_mesh or several_hosts:
        return 1
    micro = cfg.train.batch_size // max(int(cfg.optim.grad_accum_steps), 1)
    n = cores()
    while n > 1 and (micro % n or cfg.eval.batch_size % n):
        n -= 1
    return n


def apply(n: int) -> bool:
    """Asks JAX for ``n`` single-threaded CPU devices; False (and nothing changes) for
    ``n`` = 1, once JAX's backends are running, or where ``XLA_FLAGS`` already sets a
    device count."""
    if n <= 1:
        return False
    import jax
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if xla_bridge.backends_are_initialized() or "xla_force_host_platform_device_count" in flags:
        return False
    global APPLIED
    jax.config.update("jax_num_cpu_devices", n)
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_SINGLE_THREADED}".strip()
    APPLIED = True
    return True
