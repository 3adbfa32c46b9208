"""Training throughput and model FLOPs utilisation (MFU) on this machine.

Prints JSON: for each shape, tokens/s of the jitted train step and the MFU, where FLOPs per
token come from the config (6 x matmul parameters + the attention score/value products,
x3 for forward + backward) and the peak is a large float32 matmul measured in this process.

Also the seconds of the first step (tracing and compiling it) for 4, 16 and 32 layers of
the small shape, with the layers scanned and unrolled (``compile``).

    python benchmarks/train_throughput.py [--steps 30] [--shapes small,medium]
                                          [--compile-layers 4,16,32] [--skip-compile]
    python benchmarks/train_throughput.py --host    # host time per step: nested state vs leaves
    python benchmarks/train_throughput.py --quick --peer            # seconds: a smoke run
    python benchmarks/train_throughput.py --device gpu [--peer]     # bf16, cudnn + chunked

Rooflines (``benchmarks/machine.py``, measured in the same run): ``mfu`` is tokens/s x FLOPs
per token over the float32 matmul rate at the step's own matmul shapes (per device, each
shape weighted by its share of the FLOPs), ``mfu_square`` the same over a large square
matmul; with ``--device gpu`` both are bfloat16 and ``mfu`` is over the GPU's dense bf16
peak from the table. ``--peer`` trains nanoGPT's block in PyTorch back to back in this
process (``benchmarks/torch_reference.py``; skipped without torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import machine  # benchmarks/machine.py: the machine's limits, measured in this run
import numpy as np

from attnlab import devices, experiment, train
from attnlab.devices import sharding

SHAPES = {
    # The shakespeare_char baseline shape and a 6-layer / 384-wide / 256-context one.
    "small": dict(n_layers=4, n_heads=4, d_model=128, seq_len=64, batch=12),
    "medium": dict(n_layers=6, n_heads=6, d_model=384, seq_len=256, batch=64),
    # GPT-2 small at context 1024 (the GPU shape).
    "gpt2": dict(n_layers=12, n_heads=12, d_model=768, seq_len=1024, batch=8, vocab=50257),
    # The same with nanoGPT's own vocabulary, padded to a multiple of 64 for the GPU's GEMMs.
    "gpt2_v50304": dict(n_layers=12, n_heads=12, d_model=768, seq_len=1024, batch=8, vocab=50304),
}
GPU_ATTENTION = ("cudnn", "chunked")  # attention_impl values measured with --device gpu


def matmul_work(s, devices=1):
    """Forward FLOPs per step of each weight matmul shape ``(M, K, N)`` (M: a device's
    tokens); the backward pass repeats them transposed, twice."""
    D, L, V = s["d_model"], s["n_layers"], s.get("vocab", 65)
    M = max(1, s["batch"] * s["seq_len"] // devices)
    work = {(M, D, 3 * D): L, (M, D, D): L, (M, D, 4 * D): L, (M, 4 * D, D): L, (M, D, V): 1}
    return {shape: n * 2 * shape[0] * shape[1] * shape[2] for shape, n in work.items()}


def roofline(s, tps, fpt, limits, devices):
    """The step's tokens/s as fractions of the machine's limits (see the docstring)."""
    work = matmul_work(s, devices)
    rates = {k: v * 1e9 for k, v in limits["matmul_gflops"].items()}
    own = machine.weighted_peak(rates, {"x".join(map(str, k)): w for k, w in work.items()})
    out = dict(
        peak_own_shapes_gflops=round(own / 1e9, 1),
        mfu=round(tps * fpt / own, 4),
        mfu_square=round(tps * fpt / (limits["square_matmul_gflops"] * 1e9), 4),
    )
    if limits["table_bf16_tflops"]:
        out["mfu"] = round(tps * fpt / (limits["table_bf16_tflops"] * 1e12), 4)
        out["mfu_of"] = "table dense bf16 peak"
    return out


def flops_per_token(s, vocab=None):
    D, L, T = s["d_model"], s["n_layers"], s["seq_len"]
    vocab = s.get("vocab", 65) if vocab is None else vocab
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


def measure(s, steps, overrides, vocab=None, mesh=None):
    vocab = s.get("vocab", 65) if vocab is None else vocab
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
    """Milliseconds a step of a tiny model takes when the loop passes the nested NNX train
    state to a step jitted over it (``nested``: the loop before ``Trainer.flat_train_step``),
    through ``Trainer.train_step`` (``tree``: flattened and rebuilt in Python at each call)
    and as its leaves (``leaves``: what ``attnlab train`` does): the same computation, so
    the differences are host time."""
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
    nested = jax.jit(trainer._train_step, donate_argnums=0)
    steppers = {
        "nested": (lambda x: nested(x, batch)[0], lambda state: state),
        "tree": (lambda x: trainer.train_step(x, batch)[0], lambda state: state),
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
        "train_step_api_ms": round(times["tree"] * 1e3, 4),
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


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--shapes", default=None, help="default small,medium (gpu: medium,gpt2)")
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
    p.add_argument("--quick", action="store_true", help="seconds: the small shape, 3 steps")
    p.add_argument("--peer", action="store_true", help="PyTorch's step back to back (torch)")
    p.add_argument(
        "--gpu-attention",
        default=",".join(GPU_ATTENTION),
        help="with --device gpu: the attention_impl values measured, default cudnn,chunked",
    )
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    machine.add_device_flag(p)
    args = p.parse_args(argv)
    gpu = args.device == "gpu"
    args.shapes = args.shapes or ("medium,gpt2" if gpu else "small,medium")
    if args.quick:
        args.shapes, args.steps, args.skip_compile = "small", 3, True
    return args


def variants(args, dry):
    """(label, overrides) per measured setting: on a GPU bf16 with each attention path."""
    if args.device == "cpu":
        return [("float32", list(args.override))]
    bf16 = ["--config.model.dtype=bfloat16"]
    # cuDNN cannot be traced without a GPU: a dry run stands the fused XLA path in for it.
    labels = args.gpu_attention.split(",")
    impls = [("xla" if dry and i == "cudnn" else i) for i in labels]
    return [
        (
            f"bfloat16+{label}" + (f" ({i} in its place)" if i != label else ""),
            bf16 + [f"--config.model.attention_impl={i}"] + args.override,
        )
        for label, i in zip(labels, impls, strict=True)
    ]


def lowered(s, overrides):
    """Traces and lowers the train step at shape ``s`` without running it (a dry run)."""
    cfg = config_for(s, s.get("vocab", 65), overrides)
    trainer = train.Trainer(cfg, kind="lm")
    batch = {
        k: jax.ShapeDtypeStruct((s["batch"], s["seq_len"]), dt)
        for k, dt in (("inputs", np.int32), ("targets", np.int32), ("loss_mask", np.float32))
    }
    t0 = time.perf_counter()
    trainer.train_step.lower(trainer.abstract_state(), batch)
    return dict(dry_run="lowered, not run", lower_sec=round(time.perf_counter() - t0, 2))


def peer_row(name, s, args):
    """PyTorch's training step at shape ``s``, or why it was skipped."""
    try:
        import torch_reference
    except ImportError as e:
        return dict(skipped=f"no PyTorch: {e}")
    gpu = args.device == "gpu"
    return torch_reference.train_throughput(
        s, args.steps, vocab=s.get("vocab", 65), device="cuda" if gpu else "cpu", compiled=gpu
    )


def shape_rows(args, mesh, limits, dry):
    results = []
    for name in args.shapes.split(","):
        s = SHAPES[name]
        fpt = flops_per_token(s)
        shape_start = len(results)
        for label, overrides in variants(args, dry):
            row = {"shape": name, **s, "setting": label, "flops_per_token": fpt}
            if dry:
                row.update(lowered(s, overrides))
            else:
                tps, dt, first = measure(s, args.steps, overrides, mesh=mesh)
                row.update(
                    tokens_per_sec=round(tps, 1),
                    step_ms=round(dt * 1e3, 2),
                    first_step_sec=round(first, 3),
                    **roofline(s, tps, fpt, limits, jax.device_count()),
                )
            results.append(row)
            print(json.dumps(row), flush=True)
        if args.peer and not dry:
            peer = peer_row(name, s, args)
            results[-1]["peer_torch"] = peer
            if "tokens_per_sec" in peer:  # the peer's MFU against the same roofline
                scale = peer["tokens_per_sec"] / results[-1]["tokens_per_sec"]
                peer["mfu"] = round(results[-1]["mfu"] * scale, 4)
                for row in results[shape_start:]:  # each setting of this shape against the peer
                    row["vs_peer"] = round(row["tokens_per_sec"] / peer["tokens_per_sec"], 3)
            print(json.dumps({"peer_torch": peer}), flush=True)
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.host:
        row = {"benchmark": "train_host_overhead", "machine": machine.describe()}
        print(json.dumps({**row, **host_overhead(max(args.steps, 200), args.override)}))
        return
    load = [round(x, 2) for x in os.getloadavg()]  # before the runs
    mesh, explicit_mesh = None, bool(args.mesh)
    if not args.mesh and args.device == "cpu":
        names = args.shapes.split(",")
        n = min(devices.choose(config_for(SHAPES[k], 65, args.override), args.cpu_devices)
                for k in names)  # fmt: skip
        if devices.apply(n):
            args.mesh = f"data={n}"
    # Only now may JAX start: describing the machine (or checking for a GPU) starts its
    # backends, after which devices.apply could no longer split the CPU into devices.
    dry = machine.check_device(args)
    host = machine.describe() | dict(load_average=load)
    if args.mesh:
        sizes = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
        mesh = sharding.make_mesh(sizes)
    dtype = "bfloat16" if args.device == "gpu" else "float32"
    shapes = sorted(
        {k for n in args.shapes.split(",") for k in matmul_work(SHAPES[n], jax.device_count())}
    )
    limits = None if dry else machine.limits(shapes, dtype, square=1024 if args.quick else 2048,
                            repeats=2 if args.quick else 5)  # fmt: skip
    out = {
        "benchmark": "train_throughput",
        "device": args.device + (" (dry run)" if dry else ""),
        "overrides": args.override,
        "machine": host | {"load_average_end": list(os.getloadavg())},
        "limits": limits,
        "results": shape_rows(args, mesh, limits, dry),
        "mesh": args.mesh or None,
        "cpu_devices_per_core": devices.cpu.APPLIED,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "devices": jax.device_count(),
        "memory": mesh_memory(args.override, jax.device_count()) if explicit_mesh else None,
        "compile": None
        if args.skip_compile
        else compile_times([int(x) for x in args.compile_layers.split(",")], args.override),
    }
    machine.emit(out, args.out, indent=2)


if __name__ == "__main__":
    main()
