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


def run_trial(config: str, overrides: list[str], eval_at: set[int], target: float, evaluate=True):
    import jax

    from attnlab import experiment, sharding
    from attnlab.data import make_task
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
    return {
        "overrides": overrides,
        "reached": reached,
        "first_step_seconds": round(first, 2),
        "ms_per_step": round(1000 * step_seconds / steady, 1),
        "cpu_ms_per_step": round(1000 * cpu_seconds / steady, 1),
        "process_seconds": round(time.perf_counter() - start, 2),
        "load_average": [round(x, 2) for x in os.getloadavg()],
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
    eval_at = {int(s) for s in args.eval_at.split(",") if s}
    for overrides in trials:
        print(
            json.dumps(run_trial(args.config, overrides, eval_at, args.target, not args.no_eval)),
            flush=True,
        )


if __name__ == "__main__":
    main()
