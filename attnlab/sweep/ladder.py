"""Running a scaling ladder: its trials as a sweep, the fits, the check runs, the report.

An experiment defines ``LADDER = {"budgets", "target", "sizes", "variants", "min_steps",
"max_steps"}`` (``experiments/scaling_ladder.py``). ``ladder_trials`` plans every variant's
rungs (``attnlab.sweep.scaling.plan_ladder``) as trial overrides: the size's and the
variant's, and ``train.steps`` with evaluation and a checkpoint at the last step. ``main``
trains them with ``run_sweep`` in ``--workdir``, fits each variant (approaches 2 and 3, with
bootstrap intervals), trains each variant's check run (the size nearest the predicted
compute-optimal N at the target budget, for ``C / (6 N)`` tokens) in the same directory,
and writes ``ladder.json`` (rungs, fits, predictions, checks) and the report
(``attnlab.sweep.report``: ``report.md``, ``report.png``, ``isoflop.png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import time

from attnlab import experiment
from attnlab.sweep.plan import apply_overrides
from attnlab.sweep.scaling import analyse, ladder_points, loss_at, plan_ladder, scaling_params
from attnlab.sweep.spec import trial_name


def _at_steps(steps: int) -> dict:
    return {"train.steps": steps, "eval.every_steps": steps, "checkpoint.every_steps": steps,
            "train.log_every_steps": steps}  # fmt: skip


def _sizes(base, ladder, overrides: dict) -> list[int]:
    return [
        scaling_params(experiment.validate(apply_overrides(base, {**s, **overrides})))
        for s in ladder["sizes"]
    ]


def ladder_trials(experiment_file, ladder: dict, variant=None, cli_overrides=()):
    """``(trials, rungs)``: the override dicts of every rung of every variant, and the rungs
    as dicts (``trial``, ``variant``, ``budget``, ``n_params``, ``tokens``, ``steps``)."""
    spec = f"{experiment_file}:{variant}" if variant else str(experiment_file)
    base = experiment.load_config(spec, list(cli_overrides))
    tokens_per_step = int(base.train.batch_size) * int(base.data.seq_len)
    budgets, variants = ladder["budgets"], ladder["variants"]
    if variant == "tiny":  # the CPU twin: one budget, the first variant, three sizes
        budgets = [6 * 2e4 * tokens_per_step * ladder["min_steps"]]
        variants = dict(list(variants.items())[:1])
        ladder = {**ladder, "sizes": ladder["sizes"][:3]}
    trials, rungs = [], []
    for name, extra in variants.items():
        counts = _sizes(base, ladder, extra)
        planned = plan_ladder(
            budgets, ladder["sizes"], counts, tokens_per_step, min_steps=ladder["min_steps"],
            max_steps=ladder.get("max_steps"), min_sizes=1 if variant == "tiny" else 3,
        )  # fmt: skip
        for r in planned:
            overrides = {**r.size, **extra, **_at_steps(r.steps)}
            trials.append(overrides)
            rungs.append({**dataclasses.asdict(r), "variant": name, "trial": trial_name(overrides)})
    return trials, rungs


def check_rung(experiment_file, ladder, variant, extra, n_opt, cli_overrides=()) -> dict:
    """The check run of ``variant``: the size nearest ``n_opt`` (in log N) at the target."""
    base = experiment.load_config(str(experiment_file), list(cli_overrides))
    tokens_per_step = int(base.train.batch_size) * int(base.data.seq_len)
    counts = _sizes(base, ladder, extra)
    i = min(range(len(counts)), key=lambda j: abs(math.log(counts[j] / n_opt)))
    steps = max(1, round(ladder["target"] / (6 * counts[i]) / tokens_per_step))
    overrides = {**ladder["sizes"][i], **extra, **_at_steps(steps)}
    return {"trial": trial_name(overrides), "overrides": overrides, "variant": variant,
            "budget": ladder["target"], "n_params": counts[i],
            "tokens": steps * tokens_per_step, "steps": steps, "check": True}  # fmt: skip


def main(experiment_file, ladder: dict, argv) -> int:
    from attnlab import sweep
    from attnlab.sweep.report import write_report

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--bootstrap", type=int, default=100, help="resamples per fit")
    args, overrides = p.parse_known_args(argv)
    root = pathlib.Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    trials, rungs = ladder_trials(experiment_file, ladder, None, overrides)
    plan = sweep.plan_sweep(str(experiment_file), overrides, trials)
    results = sweep.run_sweep(plan, root, progress=False)
    ladder_wall = time.perf_counter() - start
    record = {"budgets": list(ladder["budgets"]), "target": ladder["target"], "rungs": rungs,
              "analysis": {}, "checks": {}, "wall_s": {"ladder": ladder_wall},
              "trials": {"ladder": len(trials)}}  # fmt: skip
    points = ladder_points(record, results)
    checks = []
    for variant, pts in points.items():
        a = analyse(pts, ladder["target"], samples=args.bootstrap)
        record["analysis"][variant] = a
        n_opt = a["predicted"]["n_opt3"]
        checks.append(check_rung(experiment_file, ladder, variant, ladder["variants"][variant],
                                 n_opt, overrides))  # fmt: skip
    for c in checks:  # the interval of the loss at the check run's own (N, D)
        a = record["analysis"][c["variant"]]
        fit = a["approach3"]
        c["predicted"] = float(loss_at(fit, c["n_params"], c["tokens"]))
        pts = points[c["variant"]]
        from attnlab.sweep.scaling import bootstrap

        iv = bootstrap(pts, ladder["target"], samples=args.bootstrap,
                       check=(c["n_params"], c["tokens"]))["l_check"]  # fmt: skip
        c["interval"] = iv
    start = time.perf_counter()
    check_plan = sweep.plan_sweep(str(experiment_file), overrides, [c["overrides"] for c in checks])
    results = sweep.run_sweep(check_plan, root, progress=False)
    record["wall_s"]["checks"] = time.perf_counter() - start
    record["trials"]["checks"] = len(checks)
    loss = {r["trial"]: r["final_eval_loss"] for r in results["trials"]}
    for c in checks:
        c["measured"] = loss.get(c["trial"])
        record["checks"][c["variant"]] = {k: v for k, v in c.items() if k != "overrides"}
        record["rungs"].append(
            {
                k: v
                for k, v in c.items()
                if k not in ("overrides", "interval", "measured", "predicted")
            }
        )
    (root / "ladder.json").write_text(json.dumps(record, indent=2, default=float) + "\n")
    for path in write_report(root):
        print(path)
    print((root / "report.md").read_text(), end="")
    return 0
