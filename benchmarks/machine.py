"""The machine a benchmark runs on, measured in the same process: its limits (rooflines).

Every benchmark prints its results next to what this machine can do at best, so a figure
reads as a fraction of the machine's own limit rather than as a ratio that moves with the
day's CPU:

* ``describe()``: the CPU's model name, the cores this process may use, the load average,
  jax/jaxlib versions, the backend and the device kind, the date;
* ``matmul_flops(shapes)``: FLOP/s of jitted matmuls at the benchmark's own shapes (each
  device doing its share at once, as the benchmark's step does), and ``square_matmul_flops``
  for a large square one;
* ``copy_bytes_per_s()``: bytes/s of a large array copy (read + write), through jax on the
  default device and through numpy on the host;
* ``read_bytes_per_s()``: bytes/s of a large array read once (a matrix-vector product over
  it, which writes almost nothing), through jax and numpy: the rate a decoding step can
  stream its weights at. A copy's figure counts its writes too, so it is no bound on reads;
* ``dense_bf16_peak(kind)``: a GPU's published dense bfloat16 peak, from ``PEAK_BF16_TFLOPS``;
* ``decode_bound(...)``: tokens/s a decoding step cannot beat: every token streams the
  weights (once per step, shared by the batch) and its row's cache, and does its FLOPs.
* ``best_seconds(call, repeats)``: the timer all of these use, and other benchmarks too.

    python benchmarks/machine.py            # the machine alone, as JSON
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

# Dense (not 2:4 sparse) bfloat16 tensor-core peaks, TFLOP/s, from the vendors' data sheets;
# the longest key contained in ``device_kind`` wins.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H100 PCIe": 756.0, "H200": 989.0, "A100": 312.0}

GPU_DTYPE = "bfloat16"  # what --device gpu computes in


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores_in_use() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def describe() -> dict:
    """What the figures were measured on (call it before the runs: the load then)."""
    import jaxlib

    device = jax.devices()[0]
    return dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=cpu_model(),
        cores_in_use=cores_in_use(),
        cpu_count=os.cpu_count(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        platform=platform.platform(),
        python=platform.python_version(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        device_kind=device.device_kind,
        device_count=jax.device_count(),
    )


def best_seconds(call, repeats):
    """The best seconds of ``call()`` over ``repeats`` runs after one untimed run (which
    compiles a jitted call and warms the caches); a call into jax waits for its result."""
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def _on_every_device(x):
    """``x`` stacked once per device on a leading axis, one slice on each device."""
    n = jax.device_count()
    x = jnp.broadcast_to(x, (n, *x.shape))
    if n == 1:
        return x
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))


def matmul_flops(shapes, dtype="float32", repeats=5) -> dict:
    """FLOP/s of ``[M, K] @ [K, N]`` for each ``(M, K, N)`` in ``shapes``, run on every device
    at once (each device its own copy: the shapes are per device), best of ``repeats``.
    Returns ``{"MxKxN": flops_per_s}``."""
    out = {}
    f = jax.jit(lambda a, b: jnp.einsum("dmk,dkn->dmn", a, b))
    for M, K, N in shapes:
        keys = jax.random.split(jax.random.key(0))
        a = _on_every_device(jax.random.normal(keys[0], (M, K), jnp.float32).astype(dtype))
        b = _on_every_device(jax.random.normal(keys[1], (K, N), jnp.float32).astype(dtype))
        seconds = best_seconds(lambda a=a, b=b: jax.block_until_ready(f(a, b)), repeats)
        out[f"{M}x{K}x{N}"] = 2 * M * K * N * jax.device_count() / seconds
    return out


def square_matmul_flops(n=2048, dtype="float32", repeats=5) -> float:
    return matmul_flops([(n, n, n)], dtype, repeats)[f"{n}x{n}x{n}"]


def weighted_peak(shape_flops: dict, work: dict) -> float:
    """The FLOP/s of a step whose matmul work (FLOPs per shape key) runs each shape at its
    measured rate: total work over the sum of the times."""
    total = sum(work.values())
    return total / sum(w / shape_flops[k] for k, w in work.items())


def copy_bytes_per_s(mib=256, repeats=5) -> dict:
    """Bytes/s moved (read + write) by copying a ``mib`` MiB float32 array, through jax on
    the default device (``x + 1`` in place, so nothing is elided) and numpy on the host."""
    n = mib * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    step = jax.jit(lambda x: x + 1, donate_argnums=0)  # in place: no fresh pages per call
    x = jax.block_until_ready(step(x))
    jax_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(step(x))
        jax_s = min(jax_s, time.perf_counter() - t0)
    del x
    src, dst = np.ones((n,), np.float32), np.empty((n,), np.float32)
    host = best_seconds(lambda: np.copyto(dst, src), repeats)
    return {"jax": 2 * 4 * n / jax_s, "numpy": 2 * 4 * n / host}


def read_bytes_per_s(mib=512, repeats=5) -> dict:
    """Bytes/s read from a ``mib`` MiB float32 matrix by a product with a vector (``[n / 4096,
    4096] @ [4096]``: every byte read once, ~0.02% as much written), larger than the CPU's
    caches, through jax on the default device and numpy on the host."""
    n = mib * 2**20 // 4
    a = jnp.ones((n // 4096, 4096), jnp.float32)
    v = jnp.ones((4096,), jnp.float32)
    matvec = jax.jit(lambda a, v: a @ v)
    jax_s = best_seconds(lambda: jax.block_until_ready(matvec(a, v)), repeats)
    del a
    a, v = np.ones((n // 4096, 4096), np.float32), np.ones((4096,), np.float32)
    host = best_seconds(lambda: a @ v, repeats)
    return {"jax": 4 * n / jax_s, "numpy": 4 * n / host}


def dense_bf16_peak(device_kind: str) -> float | None:
    """FLOP/s of the GPU's dense bfloat16 peak, or None for a kind not in the table."""
    keys = [k for k in PEAK_BF16_TFLOPS if k.lower() in device_kind.lower()]
    return PEAK_BF16_TFLOPS[max(keys, key=len)] * 1e12 if keys else None


def decode_bound(
    *, batch, weight_bytes, cache_bytes_per_row, flops_per_token, bytes_per_s, flops_per_s
):
    """Tokens/s no decoding step can beat: one step reads the weights once and each row's
    cache at ``bytes_per_s`` (the read rate), and does ``flops_per_token`` per row. Returns
    (bound, what binds it)."""
    memory = batch * bytes_per_s / (weight_bytes + batch * cache_bytes_per_row)
    compute = flops_per_s / flops_per_token
    return (memory, "bandwidth") if memory <= compute else (compute, "compute")


def limits(matmul_shapes=(), dtype="float32", square=2048, repeats=5) -> dict:
    """The machine's limits measured now: matmul FLOP/s at ``matmul_shapes`` and at a
    ``square`` matmul, copy and read bytes/s, and on a GPU the table's bf16 peak."""
    kind = jax.devices()[0].device_kind
    if jax.default_backend() == "gpu":
        square = max(square, 8192)  # a smaller product leaves a GPU's matrix units idle
    shapes = matmul_flops(matmul_shapes, dtype, repeats) if matmul_shapes else {}
    return dict(
        dtype=dtype,
        matmul_gflops={k: round(v / 1e9, 1) for k, v in shapes.items()},
        square_matmul_gflops=round(square_matmul_flops(square, dtype, repeats) / 1e9, 1),
        copy_gbps={k: round(v / 1e9, 2) for k, v in copy_bytes_per_s().items()},
        read_gbps={k: round(v / 1e9, 2) for k, v in read_bytes_per_s().items()},
        table_bf16_tflops=(dense_bf16_peak(kind) or 0) / 1e12 or None,
    )


def add_device_flag(parser):
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: bfloat16 compute, cuDNN attention, the GPU's table peak (needs a GPU; "
        "--dry-run traces the GPU settings on a CPU without timing them)",
    )
    parser.add_argument("--dry-run", action="store_true", help="with --device gpu on a CPU")


def check_device(args) -> bool:
    """Whether this run is a dry run of the GPU settings; refuses --device gpu without one."""
    gpu = jax.default_backend() == "gpu"
    if args.device == "gpu" and not gpu and not args.dry_run:
        raise SystemExit(
            "--device gpu: no GPU is visible to jax; install jax[cuda12] on a GPU machine, "
            "or add --dry-run to trace the GPU settings on this CPU"
        )
    return args.device == "gpu" and not gpu


if __name__ == "__main__":
    print(json.dumps(dict(machine=describe(), limits=limits()), indent=1))


def emit(out: dict, path: str | None = None, indent: int = 1) -> None:
    """Print a benchmark's JSON with the load average at its end in ``out["machine"]``, and
    write it to ``path`` (``--out``) when given."""
    out["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print_json(out, path, indent)


def print_json(out: dict, path: str | None = None, indent: int = 1) -> None:
    """Print ``out`` as JSON, and write it to ``path`` (``--out``) when given."""
    text = json.dumps(out, indent=indent)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
