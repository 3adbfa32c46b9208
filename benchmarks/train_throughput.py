"""Training throughput and model FLOPs utilisation (MFU) on this machine.

Prints JSON: for each shape, tokens/s of the jitted train step and the MFU, where FLOPs per
token come from the config (6 x matmul parameters + the attention score/value products,
x3 for forward + backward) and the peak is a large float32 matmul measured in this process.

Also the seconds of the first step (tracing and compiling it) for 4, 16 and 32 layers of
the small shape, with the layers scanned and unrolled (``compile``).

    python benchmarks/train_throughput.py [--steps 30] [--shapes small,medium]
                                          [--compile-layers 4,16,32] [--skip-compile]
    python benchmarks/train_throughput.py --host    # host time per step: nested state vs leaves
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from attnlab import devices, experiment, sharding, train

SHAPES = {
    # The shakespeare_char baseline shape and a 6-layer / 384-wide / 256-context one.
    "small": dict(n_layers=4, n_heads=4, d_model=128, seq_len=64, batch=12),
    "medium": dict(n_layers=6, n_heads=6, d_model=384, seq_len=256, batch=64),
}


def matmul_peak_flops(n=2048, repeats=10):
    """A large float32 matmul on every device at once: the machine's peak, whether its
    cores serve one device or one device each."""
    d = jax.device_count()
    a = jax.random.normal(jax.random.key(0), (d, n, n), jnp.float32)
    a = jax.device_put(a, jax.sharding.NamedSharding(sharding.make_mesh(), P("data")))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = f(a)
    out.block_until_ready()
    return 2 * d * n**3 * repeats / (time.perf_counter() - t0)


def flops_per_token(s, vocab):
    D, L, T = s["d_model"], s["n_layers"], s["seq_len"]
    matmul_params = L * (4 * D * D + 2 * D * 4 * D) + D * vocab  # attn, MLP, output head
    attention = L * 2 * T * D  # q.k and weights.v per token (causal half not discounted)
    return 6 * matmul_params + 6 * attention


def config_for(s, vocab, overrides):
    cfg = experiment.load_config("experiments/shakespeare_char.py", overrides)
    # The GPT-2-style block the published baseline runs: learned positions, LayerNorm
    # without bias, exact GELU, a 4x MLP, tied embeddings.
    cfg.model.update(
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        d_model=s["d_model"],
        max_len=s["seq_len"],
        vocab_size=vocab,
        position="learned",
        norm="layernorm",
        norm_bias=False,
        ffn="gelu",
        d_ff=4 * s["d_model"],
    )
    cfg.data.update(seq_len=s["seq_len"])
    cfg.train.update(batch_size=s["batch"])
    return cfg


def measure(s, steps, overrides, vocab=65, mesh=None):
    cfg = config_for(s, vocab, overrides)
    trainer = train.Trainer(cfg, kind="lm", mesh=mesh)
    state = trainer.init_state()
    rng = np.random.default_rng(0)
    batches = [
        {
            "inputs": rng.integers(0, vocab, (s["batch"], s["seq_len"]), dtype=np.int32),
            "targets": rng.integers(0, vocab, (s["batch"], s["seq_len"]), dtype=np.int32),
            "loss_mask": np.ones((s["batch"], s["seq_len"]), np.float32),
        }
        for _ in range(4)
    ]
    t0 = time.perf_counter()
    state, m = trainer.train_step(state, batches[0])  # traces and compiles the step
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    for i in range(1, 3):  # warm up
        state, m = trainer.train_step(state, batches[i % 4])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = trainer.train_step(state, batches[i % 4])
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / steps
    return s["batch"] * s["seq_len"] / dt, dt, first


def mesh_memory(overrides, devices):
    """Per-device bytes (XLA's memory analysis of the compiled train step) of a model
    replicated on every device against the same model under FSDP over all of them."""
    s = dict(SHAPES["medium"], n_layers=8, d_model=512, n_heads=8, batch=2 * devices)
    rows = {}
    for name, sizes in (("replicated", {"data": -1}), ("fsdp", {"fsdp": -1})):
        cfg = config_for(s, 65, overrides)
        trainer = train.Trainer(cfg, kind="lm", mesh=sharding.make_mesh(sizes))
        state = trainer.abstract_state()
        batch = {
            k: jax.ShapeDtypeStruct((s["batch"], s["seq_len"]), dt)
            for k, dt in (("inputs", np.int32), ("targets", np.int32), ("loss_mask", np.float32))
        }
        placed = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(
                trainer.mesh, trainer.rules, 2))
            for k, v in batch.items()
        }  # fmt: skip
        with sharding.activate(trainer.mesh, trainer.rules):
            m = trainer.train_step.lower(state, placed).compile().memory_analysis()
        rows[name] = dict(
            mesh=sizes,
            argument_mib=round(m.argument_size_in_bytes / 2**20, 1),
            temp_mib=round(m.temp_size_in_bytes / 2**20, 1),
            output_mib=round(m.output_size_in_bytes / 2**20, 1),
        )
        print(json.dumps({name: rows[name]}), flush=True)
    return rows


def host_overhead(steps, overrides):
    """Milliseconds a step of a tiny model takes when the loop passes the nested train state
    (flattened and rebuilt at every call) against its leaves (``Trainer.flat_train_step``,
    what ``attnlab train`` does): the same program, so the difference is host time."""
    s = dict(n_layers=2, n_heads=2, d_model=32, seq_len=16, batch=2)
    cfg = config_for(s, 65, overrides)
    trainer = train.Trainer(cfg, kind="lm")
    batch = {
        "inputs": np.zeros((s["batch"], s["seq_len"]), np.int32),
        "targets": np.zeros((s["batch"], s["seq_len"]), np.int32),
        "loss_mask": np.ones((s["batch"], s["seq_len"]), np.float32),
    }
    batch = jax.device_put(batch)
    treedef = jax.tree.structure(trainer.abstract_state())
    flat = trainer.flat_train_step(treedef)
    steppers = {
        "nested": (lambda x: trainer.train_step(x, batch)[0], lambda state: state),
        "leaves": (lambda x: flat(x, batch)[0], jax.tree.leaves),
    }
    times = {}
    for name, (step, start) in steppers.items():
        x = start(trainer.init_state())
        for _ in range(20):  # warm up (the program is compiled by the first call)
            x = step(x)
        jax.block_until_ready(x)
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(steps):
                x = step(x)
            jax.block_until_ready(x)
            best = min(best, (time.perf_counter() - t0) / steps)
        times[name] = best
    return {
        "shape": s,
        "nested_state_step_ms": round(times["nested"] * 1e3, 4),
        "leaves_step_ms": round(times["leaves"] * 1e3, 4),
        "host_ms_saved_per_step": round((times["nested"] - times["leaves"]) * 1e3, 4),
    }


def compile_times(layers, overrides):
    """Seconds of the first train step (trace + compile) against depth, scanned and not."""
    rows = []
    for scan in ("True", "False"):
        for L in layers:
            s = dict(SHAPES["small"], n_layers=L)
            scan_override = [f"--config.model.scan_layers={scan}"]
            _, dt, first = measure(s, 3, overrides + scan_override)
            rows.append(
                dict(
                    n_layers=L,
                    scan_layers=scan == "True",
                    first_step_sec=round(first, 3),
                    step_ms=round(dt * 1e3, 2),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--shapes", default="small,medium")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="extra --config.* overrides, e.g. --override=--config.model.ffn=relu",
    )
    p.add_argument("--compile-layers", default="4,16,32", help="depths for first-step times")
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument(
        "--host",
        action="store_true",
        help="only the host time per step: the nested train state against its leaves",
    )
    p.add_argument(
        "--mesh",
        default="",
        help="e.g. data=2: train on a mesh (set XLA_FLAGS=--xla_force_host_platform_device_count"
        "=N for N CPU devices); also reports per-device memory replicated vs FSDP",
    )
    p.add_argument(
        "--cpu-devices",
        default="auto",
        help="as ATTNLAB_CPU_DEVICES for `attnlab train`: auto (one single-threaded device per "
        "core, the default of CPU runs), 1 (one multithreaded device) or N",
    )
    args = p.parse_args()
    if args.host:
        machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__}
        row = {"benchmark": "train_host_overhead", "machine": machine, "load": os.getloadavg()}
        print(json.dumps({**row, **host_overhead(max(args.steps, 200), args.override)}))
        return
    mesh, explicit_mesh = None, bool(args.mesh)
    if not args.mesh:
        names = args.shapes.split(",")
        n = min(devices.choose(config_for(SHAPES[k], 65, args.override), args.cpu_devices)
                for k in names)  # fmt: skip
        if devices.apply(n):
            args.mesh = f"data={n}"
    if args.mesh:
        sizes = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
        mesh = sharding.make_mesh(sizes)
    peak = matmul_peak_flops()
    results = []
    for name in args.shapes.split(","):
        s = SHAPES[name]
        tps, dt, first = measure(s, args.steps, args.override, mesh=mesh)
        fpt = flops_per_token(s, 65)
        results.append(
            {
                "shape": name,
                **s,
                "tokens_per_sec": round(tps, 1),
                "step_ms": round(dt * 1e3, 2),
                "first_step_sec": round(first, 3),
                "flops_per_token": fpt,
                "mfu": round(tps * fpt / peak, 4),
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "train_throughput",
                "overrides": args.override,
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "jax": jax.__version__,
                    "backend": jax.default_backend(),
                },
                "matmul_peak_gflops": round(peak / 1e9, 1),
                "results": results,
                "mesh": args.mesh or None,
                "cpu_devices_per_core": devices.APPLIED,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "devices": jax.device_count(),
                "memory": (
                    mesh_memory(args.override, jax.device_count()) if explicit_mesh else None
                ),
                "compile": None
                if args.skip_compile
                else compile_times([int(x) for x in args.compile_layers.split(",")], args.override),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
