"""A 16-trial Optuna search on the tiny character model: TPE + ASHA against random search,
stacked against one trial after another, at the same step budget per trial.

Each search runs in a fresh process (JAX start-up, compilation and everything else counted,
as ``attnlab sweep`` would pay them) and reports its wall time and the best validation loss
it found; each arm is the mean over ``--seeds`` search seeds. Prints one JSON line per search,
then one per arm.

    python benchmarks/search.py [--trials 16] [--steps 60] [--seeds 0 1 2] [--arms ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
ARMS = {  # name: (sampler, pruner, parallel)
    "tpe_asha_stacked": ("tpe", "asha", "vmap"),
    "random_stacked": ("random", "none", "vmap"),
    "tpe_asha_sequential": ("tpe", "asha", "sequential"),
    "random_sequential": ("random", "none", "sequential"),
}


def one(arm: str, seed: int, trials: int, steps: int, stack: int, root: str) -> dict:
    from attnlab import devices, sweep

    sampler, pruner, parallel = ARMS[arm]
    every = max(steps // 6, 1)
    overrides = [
        f"--config.train.steps={steps}",
        f"--config.eval.every_steps={every}",
        f"--config.train.log_every_steps={every}",
        f"--config.checkpoint.every_steps={steps}",
        "--config.eval.batches=2",
        "--config.eval.sample_tokens=0",
        "--config.optim.warmup_steps=5",
        "--config.track.tensorboard=False",
    ]
    spec = sweep.optuna_search(
        {
            "optim.learning_rate": sweep.log_uniform(1e-3, 5e-2),
            "optim.weight_decay": sweep.uniform(0.0, 0.2),
            "model.init_std": sweep.log_uniform(0.005, 0.05),
        },
        trials,
        sampler=sampler,
        pruner=pruner,
        seed=seed,
        stack=stack,
        pruner_options={"min_resource": every, "reduction_factor": 3} if pruner == "asha" else {},
        sampler_options={"n_startup_trials": stack} if sampler == "tpe" else {},
    )
    plan = sweep.plan_search(f"{REPO / 'experiments' / 'char_lm.py'}:tiny", overrides, spec)
    devices.apply(devices.choose(plan.base))
    start = time.perf_counter()
    results = sweep.run_search(plan, root, parallel=parallel, log=lambda *_: None)
    wall = time.perf_counter() - start
    return {
        "arm": arm,
        "seed": seed,
        "wall_s": round(wall, 1),
        "best_eval_loss": results["best"]["value"] if results["best"] else None,
        "outcomes": results["outcomes"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--stack", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--one", nargs=3, metavar=("ARM", "SEED", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        arm, seed, root = args.one
        print(json.dumps(one(arm, int(seed), args.trials, args.steps, args.stack, root)))
        return
    summary = {}
    for arm in args.arms.split(","):
        runs = []
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as root:
                cmd = [sys.executable, __file__, "--one", arm, str(seed), root]
                cmd += ["--trials", str(args.trials), "--steps", str(args.steps)]
                cmd += ["--stack", str(args.stack)]
                start = time.perf_counter()
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                record = json.loads(out.stdout.strip().splitlines()[-1])
                record["process_s"] = round(time.perf_counter() - start, 1)
                print(json.dumps(record), flush=True)
                runs.append(record)
        losses = [r["best_eval_loss"] for r in runs if r["best_eval_loss"] is not None]
        summary[arm] = {
            "searches": len(runs),
            "process_s_mean": round(statistics.fmean(r["process_s"] for r in runs), 1),
            "search_s_mean": round(statistics.fmean(r["wall_s"] for r in runs), 1),
            "best_eval_loss_mean": round(statistics.fmean(losses), 4) if losses else None,
            "pruned_mean": statistics.fmean(r["outcomes"]["pruned"] for r in runs),
        }
        print(json.dumps({"arm": arm, **summary[arm]}), flush=True)


if __name__ == "__main__":
    main()
