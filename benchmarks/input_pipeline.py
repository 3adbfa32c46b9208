"""Input pipeline throughput, the fraction of the train step spent waiting on data, startup.

Writes a prepared corpus of random documents (``--tokens`` byte tokens, document lengths
drawn from a geometric distribution of mean ``--doc-len``), then for each way of running
the Grain pipeline ("index": windows read by index from a ``MapDataset``; "grain": packed
batches in the training thread, the default; "grain+thread": the same with a prefetch
thread; "grain+workers=N": ``data.workers=N`` worker processes):

- ``batches_per_sec``: batches the task gives alone, no model;
- ``wait_fraction``: in a training loop of a small model (the jitted train step of
  ``attnlab.train.Trainer``, dispatched asynchronously as ``attnlab train`` does), the
  seconds spent getting the next batch over the loop's wall time;
- ``step_ms``: the loop's wall time per step.

``startup_s``: seconds from a fresh interpreter's start to the first training batch of the
tiny char_lm experiment (median of ``--startup-runs``), per pipeline. ``load`` is the
machine's load average when each figure was taken (the machine may be shared).

    python benchmarks/input_pipeline.py [--tokens 4000000] [--batch 16] [--seq-len 256] [--quick]

Roofline (``benchmarks/machine.py``, measured in the same run): the pipeline is host
Python, bound by neither matmuls nor bandwidth, so ``of_copy_bandwidth`` (the batches'
int32 bytes per second over the host's numpy copy rate) only says how far from the
memory system it is; the figure that matters is ``wait_fraction``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import machine  # benchmarks/machine.py: the machine and its limits, measured in this run
import numpy as np

from attnlab import experiment, train
from attnlab.data import make_task
from attnlab.data.prepared import write_prepared
from attnlab.data.tokenizers import ByteTokenizer


def write_corpus(out, tokens: int, doc_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(1 / doc_len, size=2 * tokens // doc_len + 16)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), tokens) + 1]
    data = rng.integers(97, 123, int(lengths.sum()), dtype=np.uint8).tobytes().decode()
    docs = np.split(np.frombuffer(data.encode(), np.uint8), np.cumsum(lengths)[:-1])
    texts = [d.tobytes().decode() for d in docs]
    write_prepared(
        [("random", len(data), lambda: texts, True)], out, ByteTokenizer(), progress=False
    )
    return len(texts)


def batches_per_sec(task, batch, n):
    task.train_batch(0, 0, batch)
    t0 = time.perf_counter()
    for step in range(1, n + 1):
        task.train_batch(0, step, batch)
    return n / (time.perf_counter() - t0)


def wait_fraction(task, cfg, steps):
    trainer = train.Trainer(cfg, kind="lm")
    state = trainer.init_state()
    state, m = trainer.train_step(state, task.train_batch(0, 0, cfg.train.batch_size))
    jax.block_until_ready(m)  # compiled
    waiting, t0 = 0.0, time.perf_counter()
    for step in range(1, steps + 1):
        t = time.perf_counter()
        batch = task.train_batch(0, step, cfg.train.batch_size)
        waiting += time.perf_counter() - t
        state, m = trainer.train_step(state, batch)
    jax.block_until_ready(m)
    wall = time.perf_counter() - t0
    return waiting / wall, 1000 * wall / steps


FIRST_BATCH = """
import time; t0 = time.perf_counter()
from attnlab import experiment
from attnlab.data import make_task
cfg = experiment.load_config("experiments/char_lm.py:tiny", {overrides!r})
make_task(cfg.data).train_batch(int(cfg.train.seed), 0, int(cfg.train.batch_size))
print(time.perf_counter() - t0)
"""


def startup_seconds(pipeline: str, runs: int) -> float:
    """Median seconds from a fresh interpreter to the tiny char_lm's first batch."""
    code = FIRST_BATCH.format(overrides=[f"--config.data.pipeline={pipeline}"])
    times = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.split()[-1])
        for _ in range(runs)
    ]  # fmt: skip
    return statistics.median(times)


def _task(data, variant):
    """The task of ``data`` run the way ``variant`` names."""
    pipeline, _, extra = variant.partition("+")
    workers = int(extra.split("=")[1]) if extra.startswith("workers") else 0
    task = make_task({**data, "pipeline": pipeline, "workers": workers})
    if extra == "thread":  # the packed pipeline with a prefetch thread
        import grain

        make = task._train_batches._make
        task._train_batches._make = lambda seed, batch: (
            grain.experimental.ThreadPrefetchIterDataset(make(seed, batch), prefetch_buffer_size=2)
        )
    return task


def load() -> float:
    return round(os.getloadavg()[0], 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4_000_000)
    p.add_argument("--doc-len", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batches", type=int, default=300, help="batches timed without a model")
    p.add_argument("--steps", type=int, default=40, help="train steps timed")
    p.add_argument("--startup-runs", type=int, default=5)
    p.add_argument("--variants", default="index,grain,grain+thread,grain+workers=1,grain+workers=2")
    p.add_argument("--quick", action="store_true", help="seconds: 200k tokens, 2 pipelines")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.batches, args.steps, args.startup_runs = 200_000, 20, 5, 0
        args.variants = "index,grain"
    machine_row = machine.describe()
    copy = machine.copy_bytes_per_s()["numpy"]
    report = {
        "benchmark": "input_pipeline",
        "machine": machine_row | {"jax_devices": [str(d) for d in jax.devices()]},
        "limits": {"copy_gbps_numpy": round(copy / 1e9, 2)},
        "config": vars(args),
        "pipelines": {},
        "startup_s": {},
    }
    for pipeline in ("index", "grain"):
        if args.startup_runs:
            row = {"seconds": round(startup_seconds(pipeline, args.startup_runs), 3)}
            report["startup_s"][pipeline] = {**row, "load": load()}
            print(json.dumps({f"startup {pipeline}": report["startup_s"][pipeline]}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report["config"]["documents"] = write_corpus(tmp, args.tokens, args.doc_len)
        cfg = experiment.load_config("experiments/char_lm.py:tiny")
        cfg.model.update(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_len=args.seq_len)
        cfg.train.update(batch_size=args.batch)
        data = {"kind": "prepared", "path": tmp, "seq_len": args.seq_len}
        for variant in args.variants.split(","):
            task = _task(data, variant)
            rate = batches_per_sec(task, args.batch, args.batches)
            waiting, step_ms = wait_fraction(_task(data, variant), cfg, args.steps)
            row = {
                "batches_per_sec": round(rate, 1),
                "tokens_per_sec": round(rate * args.batch * args.seq_len),
                "of_copy_bandwidth": round(rate * args.batch * args.seq_len * 4 / copy, 6),
                "wait_fraction": round(waiting, 4),
                "step_ms": round(step_ms, 2),
                "load": load(),
            }
            b = task.train_batch(0, 1, args.batch)
            if "segment_ids" in b:
                row["packed_token_fraction"] = round(float((b["segment_ids"] > 0).mean()), 4)
            report["pipelines"][variant] = row
            print(json.dumps({variant: row}), flush=True)
    machine.print_json(report, args.out)


if __name__ == "__main__":
    main()
