"""How many CPU devices a run asks JAX for: one per core for training on a CPU-only machine.

XLA:CPU gives each op of a train step every core, and at the widths researchers train on
a laptop or a small server the ops are too small for that to pay: the cores spend the
step waiting for each other. Splitting the batch over one single-threaded device per core
(a ``data`` mesh, ``attnlab.devices.sharding``) keeps every core busy on its own half. On 2 cores
this measured 1.44x the tokens/s of one device at 4 layers x 128 and 1.29x at 6 x 384
(``benchmarks/train_throughput.py --cpu-devices 1`` for the other; the README's benchmarks).

``ATTNLAB_CPU_DEVICES`` chooses: ``auto`` (the default) one device per core where the
experiment keeps the default mesh (every device on ``data``) and its batches divide, ``1``
(or ``off``) one device with multithreaded ops, ``N`` exactly N devices. It must act
before JAX starts its backends, so ``attnlab train`` applies it first thing; a process
that already used JAX keeps what it has. A machine with an accelerator is unaffected: its
runs use the accelerator, and this only shapes the CPU backend.
"""

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
