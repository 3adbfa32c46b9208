"""Tokens to a validation loss, a property of the recipe: trains an experiment in this
process and evaluates it on every window of the validation split (as ``attnlab eval
--full`` does) at the steps asked for, without the clock of a cold ``attnlab train``.

Each trial is the experiment with its own dotted overrides (separated by ``--``); prints
one JSON line per evaluation with the tokens seen so far, then one per trial with the
first evaluated step at or below ``--target``, the first step's seconds (compiling it) and
the wall and CPU milliseconds of each later step (the machine's load average beside them:
the seconds are the load's, the tokens the recipe's). ``--no-eval`` times the steps alone.

    python benchmarks/speedrun_search.py --config experiments/shakespeare_speedrun.py \\
        --eval-at 150,200 -- --config.train.steps=200 -- --config.model.n_layers=3

An evaluation before the last step sees the schedule's learning rate mid-way, so only the
last step is the recipe's own figure; the earlier ones say how far it is from the target.

Each trial's line also carries its roofline (``benchmarks/machine.py``, measured once per
process): ``flops_per_step`` (6 x the matrices' and the tied head's parameters x tokens, plus
attention's products, as ``train_throughput.py`` counts them; and with Muon its
Newton-Schulz iterations, ``ns_flops_per_step``: 4 m^2 n + 2 m^3 an iteration for each
layer's m x n matrix, m <= n), ``floor_ms_per_step`` (those FLOPs at the square float32
matmul rate of all the devices at once) and ``of_roofline`` (the floor over the measured
step). ``floor_loop_seconds`` is the whole loop's floor: no step of this recipe can beat it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def trials_of(argv: list[str]) -> tuple[list[str], list[list[str]]]:
    """The arguments before the first ``--`` and each trial's overrides after it."""
    groups, current = [], []
    for a in argv:
        if a == "--":
            groups.append(current)
            current = []
        else:
            current.append(a)
    groups.append(current)
    return groups[0], groups[1:] or [[]]


def work_per_step(cfg, params) -> dict:
    """FLOPs of one training step of ``cfg`` (see the module docstring): the model's and,
    with Muon, its Newton-Schulz iterations'."""
    import math

    import jax
    import optax

    from attnlab import experiment
    from attnlab.contracts.optimizer import muon_dimensions

    m = experiment.model_config(cfg)
    tokens = int(cfg.train.batch_size) * int(cfg.data.seq_len)
    dims = muon_dimensions(params)
    matrix_params, ns = 0, 0
    steps = int(cfg.optim.get("muon_ns_steps", 5)) if cfg.optim.name == "muon" else 0
    is_dims = lambda d: d is None or isinstance(d, optax.contrib.MuonDimensionNumbers)
    for d, x in zip(jax.tree.leaves(dims, is_leaf=is_dims), jax.tree.leaves(params), strict=True):
        if d is None:  # not a matrix: Adam's, and no matmul of its own
            continue
        rows = math.prod(x.shape[a] for a in d.reduction_axis)
        cols = math.prod(x.shape[a] for a in d.output_axis)
        layers = x.size // (rows * cols)
        matrix_params += x.size
        small, big = sorted((rows, cols))
        ns += layers * steps * (4 * small * small * big + 2 * small**3)
    per_token = 6 * (matrix_params + m.d_model * m.vocab_size)
    per_token += 6 * m.n_layers * 2 * int(cfg.data.seq_len) * m.d_model
    return {"flops_per_step": per_token * tokens + ns, "ns_flops_per_step": ns}


def run_trial(config, overrides, eval_at, target, evaluate, peak):
    """One trial (``peak``: the square matmul FLOP/s its roofline is over)."""
    import jax

    from attnlab import experiment
    from attnlab.data import make_task
    from attnlab.devices import sharding
    from attnlab.train import Trainer

    cfg = experiment.load_config(config, overrides)
    task = make_task(cfg.data, None)
    trainer = Trainer(cfg, kind=task.kind, mesh=sharding.mesh_from_config(cfg))
    B, T, total = int(cfg.train.batch_size), int(cfg.data.seq_len), trainer.total_steps
    full = list(task.full_eval_batches(256))
    start = time.perf_counter()
    state = trainer.init_state()
    seed, reached, step_seconds, cpu_seconds = int(cfg.train.seed), None, 0.0, 0.0
    first = None
    for step in range(total):
        t0, c0 = time.perf_counter(), time.process_time()
        state, _ = trainer.train_step(state, task.train_batch(seed, step, B))
        done = step + 1
        if first is None:
            jax.block_until_ready(state)
            first = time.perf_counter() - t0
            continue
        if evaluate and (done in eval_at or done == total):
            jax.block_until_ready(state)
            step_seconds += time.perf_counter() - t0
            cpu_seconds += time.process_time() - c0
            record = trainer.evaluate(state["params"], full)
            out = {"step": done, "tokens": done * B * T, "eval_loss": round(record["eval_loss"], 5)}
            print(json.dumps({"overrides": overrides, **out}), flush=True)
            if reached is None and record["eval_loss"] <= target:
                reached = out
        else:
            step_seconds += time.perf_counter() - t0
            cpu_seconds += time.process_time() - c0
    jax.block_until_ready(state)
    steady = max(total - 1, 1)
    work = work_per_step(cfg, state["params"])
    floor_ms = 1e3 * work["flops_per_step"] / peak
    roof = dict(work, square_matmul_gflops=round(peak / 1e9, 1),
                floor_ms_per_step=round(floor_ms, 1),
                floor_loop_seconds=round(floor_ms * total / 1e3, 2),
                of_roofline=round(floor_ms / (1000 * step_seconds / steady), 3))  # fmt: skip
    return {
        "overrides": overrides,
        "reached": reached,
        "first_step_seconds": round(first, 2),
        "ms_per_step": round(1000 * step_seconds / steady, 1),
        "cpu_ms_per_step": round(1000 * cpu_seconds / steady, 1),
        "process_seconds": round(time.perf_counter() - start, 2),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "roofline": roof,
    }


def main():
    own, trials = trials_of(sys.argv[1:])
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "experiments" / "shakespeare_speedrun.py"))
    p.add_argument("--eval-at", default="", help="steps to evaluate at besides the last")
    p.add_argument("--target", type=float, default=1.886)
    p.add_argument("--no-eval", action="store_true", help="time the steps alone")
    args = p.parse_args(own)
    sys.path.insert(0, str(REPO))
    from attnlab import devices, experiment

    devices.apply(devices.choose(experiment.load_config(args.config)))
    sys.path.insert(0, str(REPO / "benchmarks"))
    import machine  # benchmarks/machine.py

    peak = machine.square_matmul_flops()
    print(json.dumps({"machine": machine.describe(), "square_matmul_gflops": peak / 1e9}))
    eval_at = {int(s) for s in args.eval_at.split(",") if s}
    for overrides in trials:
        out = run_trial(args.config, overrides, eval_at, args.target, not args.no_eval, peak)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
