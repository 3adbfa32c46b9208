"""The learning-rate transfer experiment: the same sweep in several parametrisations, its
best learning rate per width (or depth), and the figure.

``main(experiment_file, argv)`` runs the experiment's ``sweep(variant)`` for each variant
(``--variants``, default ``standard,mup,depth_standard,depth_completep`` and then the
optimisers' ``opt_*``) in ``--workdir/<variant>``, then writes ``transfer.md`` (per variant
and size: the best learning rate, its grid index, its loss; whether the best moved by more
than one grid step, and whether a larger size was ever worse) and ``transfer.png``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from attnlab.sweep.report import best_values, curve, finished, plot_objective, size_key
from attnlab.sweep.results import collect

LR = "optim.learning_rate"
DEFAULT_VARIANTS = ("standard", "mup", "depth_standard", "depth_completep")


def summarise(results: dict) -> dict:
    """``{"size_key", "rows": [{size, best_lr, index, loss}], "shift", "wider_never_worse"}``:
    ``shift`` the largest distance in grid steps between two sizes' best rates."""
    rows = finished(results)
    by = size_key(results)
    grid = sorted({r["overrides"][LR] for r in rows})
    best = best_values(rows, LR, by)
    out = [
        {"size": s, "best_lr": v, "index": grid.index(v), "loss": m} for s, (v, m) in best.items()
    ]
    indices = [r["index"] for r in out]
    losses = [r["loss"] for r in out]
    return {
        "size_key": by,
        "rows": out,
        "shift": max(indices) - min(indices) if indices else None,
        "wider_never_worse": all(b <= a for a, b in zip(losses, losses[1:], strict=False)),
    }


def markdown(summaries: dict, timings: dict) -> str:
    lines = ["| variant | size | best learning rate | grid index | loss at best (mean of seeds) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for variant, s in summaries.items():
        for r in s["rows"]:
            key = s["size_key"].split(".")[-1]
            lines.append(f"| {variant} | {key}={r['size']} | {r['best_lr']:g} | {r['index']} | "
                         f"{r['loss']:.4f} |")  # fmt: skip
    lines += ["", "| variant | best rate moved (grid steps) | larger never worse | trials | "
              "stacked per program | wall s |", "|---|---|---|---|---|---|"]  # fmt: skip
    for variant, s in summaries.items():
        t = timings.get(variant, {})
        lines.append(f"| {variant} | {s['shift']} | {'yes' if s['wider_never_worse'] else 'no'} "
                     f"| {t.get('trials', '')} | {t.get('stacked', '')} | "
                     f"{t.get('wall_s', float('nan')):.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def figure(results_by_variant: dict):
    """One panel per variant: loss against learning rate, a line per size (best starred)."""
    from matplotlib.figure import Figure

    n = len(results_by_variant)
    cols = min(n, 4)
    rows = -(-n // cols)
    fig = Figure(figsize=(4.0 * cols, 3.3 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (variant, results) in zip(axes, results_by_variant.items(), strict=False):
        by = size_key(results)
        for line, pts in curve(finished(results), LR, by).items():
            xs, ms = [p[0] for p in pts], [p[1] for p in pts]
            ss = [p[2] for p in pts]
            (h,) = ax.plot(xs, ms, marker="o", ms=3, label=f"{by.split('.')[-1]}={line}")
            ax.fill_between(xs, [m - s for m, s in zip(ms, ss, strict=True)],
                            [m + s for m, s in zip(ms, ss, strict=True)], color=h.get_color(),
                            alpha=0.15, lw=0)  # fmt: skip
            i = min(range(len(ms)), key=ms.__getitem__)
            ax.plot([xs[i]], [ms[i]], marker="*", ms=12, color=h.get_color())
        ax.set_xscale("log", base=2)
        ax.set_title(variant, fontsize="medium")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("final eval loss")
        lo = min(p[1] for pts in curve(finished(results), LR, by).values() for p in pts)
        ax.set_ylim(lo - 0.05, lo + 0.9)
        ax.legend(fontsize="x-small")
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig


def run(experiment_file: str, variants, workdir, overrides=(), log=print) -> dict:
    """Runs each variant's sweep (stacked groups), returns ``{variant: (results, timing)}``."""
    from attnlab import sweep

    out = {}
    for variant in variants:
        plan = sweep.load_sweep(f"{experiment_file}:{variant}", list(overrides))
        groups = sweep.group_trials(plan.trials, "vmap")
        start = time.perf_counter()
        results = sweep.run_sweep(plan, pathlib.Path(workdir) / variant, progress=False, log=log)
        timing = {
            "trials": len(plan.trials),
            "stacked": max(len(g.trials) for g in groups),
            "programs": len(groups),
            "wall_s": time.perf_counter() - start,
        }
        out[variant] = (results, timing)
    return out


def main(experiment_file: str, argv) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--figure", default="transfer.png", help="its name in --workdir")
    args, overrides = p.parse_known_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    root = pathlib.Path(args.workdir)
    ran = run(experiment_file, variants, root, overrides)
    timings_path = root / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    timings.update({v: t for v, (_, t) in ran.items()})
    timings_path.write_text(json.dumps(timings, indent=2) + "\n")
    done = [d.name for d in sorted(root.iterdir()) if (d / "sweep.json").exists()]
    results = {v: collect(root / v) for v in done}
    summaries = {v: summarise(r) for v, r in results.items()}
    (root / "transfer.md").write_text(markdown(summaries, timings))
    order = [v for v in (*DEFAULT_VARIANTS, *sorted(results)) if v in results]
    width = {v: results[v] for v in order if v in DEFAULT_VARIANTS}
    others = {v: results[v] for v in order if v not in DEFAULT_VARIANTS}
    if width:
        figure(width).savefig(root / args.figure, dpi=110)
    if others:
        figure(others).savefig(root / ("optimizers_" + args.figure), dpi=110)
    for v in variants:
        plot_objective(results[v], title=v).savefig(root / v / "report.png", dpi=110)
    print((root / "transfer.md").read_text(), end="")
    return 0
