"""A sweep's report: one Markdown page and its figures, from the sweep's directory alone.

``write_report(DIR)`` reads what ``collect`` reads (the trials' files), and writes
``DIR/report.md`` with ``DIR/report.png``: the objective (final eval loss, mean +- std over
seeds) against each swept value, one line per width or depth (``SIZE_KEYS``) when the sweep
varies one; the best trials; the best value of each swept key per width; Optuna's parameter
importances when ``DIR/study.db`` holds a search; and a scaling ladder's fits when
``DIR/ladder.json`` is there (``attnlab.sweep.scaling``). ``attnlab report DIR`` runs it.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics

from attnlab.sweep.results import collect
from attnlab.sweep.spec import format_value

# Keys whose values are model sizes: the report draws a line per value rather than an axis.
SIZE_KEYS = ("model.d_model", "model.n_layers")
# Keys a sweep sets along with others (a ladder's cadence at its steps): no panel, no table.
CADENCE_KEYS = ("train.seed", "eval.every_steps", "checkpoint.every_steps",
                "train.log_every_steps")  # fmt: skip
OBJECTIVE = "final_eval_loss"


def finished(results: dict) -> list[dict]:
    return [
        r for r in results["trials"]
        if r["status"] == "finished" and r.get(OBJECTIVE) is not None
        and math.isfinite(r[OBJECTIVE])
    ]  # fmt: skip


def size_key(results: dict) -> str | None:
    """The swept key that is a model size (the line per value), or None."""
    return next((k for k in SIZE_KEYS if k in results["keys"]), None)


def curve(rows, x: str, by: str | None) -> dict:
    """``{by value: [(x value, mean, std, n)]}``: the objective over seeds (and any other
    keys) per value of ``x``, for each value of ``by``, sorted by ``x``."""
    cells: dict = {}
    for r in rows:
        o = r["overrides"]
        if x not in o:
            continue
        cells.setdefault(o.get(by) if by else None, {}).setdefault(o[x], []).append(r[OBJECTIVE])
    out = {}
    for line, points in cells.items():
        out[line] = [
            (v, statistics.fmean(ys), statistics.stdev(ys) if len(ys) > 1 else 0.0, len(ys))
            for v, ys in sorted(points.items())
        ]
    return dict(sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0])))


def best_values(rows, x: str, by: str | None) -> dict:
    """``{by value: (best x value, its mean objective)}``."""
    return {
        line: min(((v, m) for v, m, _, _ in pts), key=lambda vm: vm[1])
        for line, pts in curve(rows, x, by).items()
    }


def plot_objective(results: dict, keys=None, title: str = ""):
    """One panel per swept key (not seeds, not the size key): the objective's mean +- std
    over seeds against the key's values, a line per width or depth. Log axis for rates."""
    from matplotlib.figure import Figure

    from attnlab.sweep.results import LOG_X_LEAVES

    by = size_key(results)
    keys = keys or [k for k in results["keys"] if k not in (*CADENCE_KEYS, by)] or [by]
    rows = finished(results)
    fig = Figure(figsize=(4.2 * len(keys), 3.4), layout="constrained")
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=True):
        for line, pts in curve(rows, key, by if key != by else None).items():
            if not pts or not all(isinstance(p[0], int | float) for p in pts):
                continue
            xs, ms, ss = [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
            label = None if line is None else f"{by.split('.')[-1]}={line}"
            (h,) = ax.plot(xs, ms, marker="o", ms=3, label=label)
            ax.fill_between(xs, [m - s for m, s in zip(ms, ss, strict=True)],
                            [m + s for m, s in zip(ms, ss, strict=True)], color=h.get_color(),
                            alpha=0.15, lw=0)  # fmt: skip
            i = min(range(len(ms)), key=ms.__getitem__)
            ax.plot([xs[i]], [ms[i]], marker="*", ms=11, color=h.get_color())
        if key.rsplit(".", 1)[-1] in LOG_X_LEAVES:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(key)
        ax.set_ylabel("final eval loss")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    if title:
        fig.suptitle(title, fontsize="medium")
    return fig


def _table(head, rows) -> list[str]:
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"
    return [line(head), "|" + "---|" * len(head), *(line(r) for r in rows), ""]


def importances(root: pathlib.Path) -> dict | None:
    """Optuna's parameter importances (fANOVA by default) of ``DIR/study.db``, or None."""
    db = root / "study.db"
    if not db.exists():
        return None
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{db}"
    names = optuna.study.get_all_study_names(storage)
    if not names:
        return None
    return study_importances(optuna.load_study(study_name=names[0], storage=storage))


def study_importances(study) -> dict | None:
    """``optuna.importance.get_param_importances`` (fANOVA) of a study with two or more
    finished trials, else None."""
    import optuna

    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if len(done) < 2 or not done[0].params:
        return None
    return dict(optuna.importance.get_param_importances(study))


def report_lines(root: pathlib.Path, results: dict) -> list[str]:
    rows = finished(results)
    by = size_key(results)
    keys = [k for k in results["keys"] if k not in (*CADENCE_KEYS, by)]
    lines = [f"# Sweep report: {root.name}", ""]
    lines.append(f"{len(results['trials'])} trial(s), {len(rows)} finished; objective: the "
                 "final eval loss (mean ± std over seeds). ![objective](report.png)")  # fmt: skip
    lines.append("")
    best = sorted(rows, key=lambda r: r[OBJECTIVE])[:5]
    lines += ["## Best trials", ""]
    lines += _table(
        ["trial", "final eval loss"], [[r["trial"], f"{r[OBJECTIVE]:.4f}"] for r in best]
    )
    for key in keys:
        lines += [f"## {key}", ""]
        table = []
        for line, pts in curve(rows, key, by).items():
            for v, m, s, n in pts:
                spread = f"{m:.4f} ± {s:.4f}" if n > 1 else f"{m:.4f}"
                table.append([line if by else "", format_value(v), spread, n])
        lines += _table([by or "", key, "final eval loss", "seeds"], table)
        if by:
            lines += [f"Best {key} per {by}:", ""]
            lines += _table([by, f"best {key}", "loss"],
                            [[w, format_value(v), f"{m:.4f}"]
                             for w, (v, m) in best_values(rows, key, by).items()])  # fmt: skip
    imp = importances(root)
    if imp:
        lines += ["## Parameter importances (Optuna)", ""]
        lines += _table(["parameter", "importance"], [[k, f"{v:.3f}"] for k, v in imp.items()])
    ladder = root / "ladder.json"
    if ladder.exists():
        from attnlab.sweep.scaling import fit_lines

        lines += fit_lines(json.loads(ladder.read_text()), results)
    return lines


def write_report(workdir) -> list[pathlib.Path]:
    """Writes ``DIR/report.md`` and ``DIR/report.png`` (and the ladder's figure when it is a
    ladder); returns their paths."""
    root = pathlib.Path(workdir)
    results = collect(root)
    paths = [root / "report.md", root / "report.png"]
    paths[0].write_text("\n".join(report_lines(root, results)) + "\n")
    plot_objective(results, title=root.name).savefig(paths[1], dpi=110)
    ladder = root / "ladder.json"
    if ladder.exists():
        from attnlab.sweep.scaling import plot_ladder

        plot_ladder(json.loads(ladder.read_text()), results).savefig(root / "isoflop.png", dpi=110)
        paths.append(root / "isoflop.png")
    return paths


def add_parser(sub, parents):
    r = sub.add_parser(
        "report", parents=parents,
        help="a sweep's page: report.md and report.png (objective per swept value, best "
        "trials, Optuna importances, a ladder's fits)",
    )  # fmt: skip
    r.add_argument("dir", help="the sweep's work directory")
    r.set_defaults(fn=_report)


def _report(args, overrides):
    for path in write_report(args.dir):
        print(path)
