"""Input pipeline throughput, and the fraction of the train step spent waiting on data.

Writes a prepared corpus of random documents (``--tokens`` byte tokens, document lengths
drawn from a geometric distribution of mean ``--doc-len``), then for each ``data.pipeline``
("index": windows read by index; "grain": Grain's packed batches, prefetched by a thread):

- ``batches_per_sec``: batches the task gives alone, no model;
- ``wait_fraction``: in a training loop of a small model (the jitted train step of
  ``attnlab.train.Trainer``, dispatched asynchronously as ``attnlab train`` does), the
  seconds spent getting the next batch over the loop's wall time;
- ``step_ms``: the loop's wall time per step.

    python benchmarks/input_pipeline.py [--tokens 4000000] [--batch 16] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import jax
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4_000_000)
    p.add_argument("--doc-len", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batches", type=int, default=300, help="batches timed without a model")
    p.add_argument("--steps", type=int, default=40, help="train steps timed")
    args = p.parse_args()
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "jax_devices": [str(d) for d in jax.devices()],
        },
        "config": vars(args),
        "pipelines": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        report["config"]["documents"] = write_corpus(tmp, args.tokens, args.doc_len)
        cfg = experiment.load_config("experiments/char_lm.py:tiny")
        cfg.model.update(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_len=args.seq_len)
        cfg.train.update(batch_size=args.batch)
        for pipeline in ("index", "grain"):
            data = {"kind": "prepared", "path": tmp, "seq_len": args.seq_len}
            task = make_task({**data, "pipeline": pipeline})
            rate = batches_per_sec(task, args.batch, args.batches)
            waiting, step_ms = wait_fraction(
                make_task({**data, "pipeline": pipeline}), cfg, args.steps
            )
            row = {
                "batches_per_sec": round(rate, 1),
                "tokens_per_sec": round(rate * args.batch * args.seq_len),
                "wait_fraction": round(waiting, 4),
                "step_ms": round(step_ms, 2),
            }
            if pipeline == "grain":
                b = task.train_batch(0, 1, args.batch)
                row["packed_token_fraction"] = round(float((b["segment_ids"] > 0).mean()), 4)
            report["pipelines"][pipeline] = row
            print(json.dumps({pipeline: row}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
