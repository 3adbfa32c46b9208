"""Sweep results, rebuilt from the trial directories alone.

``collect(DIR)`` reads each trial's ``config.json``, ``metrics.jsonl`` and ``status.json``
(trials started by ``attnlab train`` from ``--print-commands`` have no status: a trial whose
last logged step is ``train.steps`` counts as finished, a non-finite loss as failed). The
trials and their overrides come from ``DIR/sweep.json``; without it, every subdirectory with
a ``config.json`` is a trial and its overrides are the config values that differ between
trials. When a sweep varies ``train.seed``, trials that share their other overrides are
aggregated into mean and sample standard deviation over seeds.

``write_results`` writes ``results.json``, ``results.csv`` (trial rows, then aggregate rows),
``loss_curves.png`` and ``final_metric.png`` (the final loss against each swept key).
"""

from __future__ import annotations

import csv
import io
import json
import math
import pathlib
import statistics

from attnlab.experiment import flat_keys
from attnlab.sweep.spec import format_value

TRIAL_FIELDS = (
    "kind",
    "trial",
    "status",
    "steps",
    "final_eval_loss",
    "final_eval_loss_std",
    "best_eval_loss",
    "best_eval_loss_std",
    "final_train_loss",
    "final_eval_accuracy",
    "wall_sec",
    "seeds",
    "mode",
)
LOG_X_LEAVES = ("learning_rate", "weight_decay", "eps", "init_std")


def _read_json(path: pathlib.Path):
    return json.loads(path.read_text()) if path.exists() else None


def _metrics(trial_dir: pathlib.Path) -> list[dict]:
    path = trial_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trials(root: pathlib.Path) -> list[tuple[str, dict]]:
    manifest = _read_json(root / "sweep.json")
    if manifest is not None:
        return [(t["name"], t["overrides"]) for t in manifest["trials"]]
    dirs = sorted(p for p in root.iterdir() if (p / "config.json").exists())
    configs = {d.name: flat_keys(json.loads((d / "config.json").read_text())) for d in dirs}
    keys = sorted({k for c in configs.values() for k in c})
    varied = [k for k in keys if len({json.dumps(c.get(k)) for c in configs.values()}) > 1]
    return [(name, {k: c.get(k) for k in varied}) for name, c in configs.items()]


def _trial_row(root: pathlib.Path, name: str, overrides: dict) -> dict:
    trial_dir = root / name
    cfg = _read_json(trial_dir / "config.json")
    records = _metrics(trial_dir)
    status = _read_json(trial_dir / "status.json") or {}
    last = records[-1] if records else {}
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    finite = [x for x in evals if math.isfinite(x)]
    accs = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    steps = int(last.get("step", 0))
    state = status.get("status")
    if state is None:  # run outside the sweep runner: infer from the files
        if cfg is None:
            state = "missing"
        elif records and not math.isfinite(last.get("train_loss", 0.0)):
            state = "failed"
        else:
            state = "finished" if steps >= int(cfg["train"]["steps"]) else "incomplete"
    reason = status.get("reason")
    if state == "failed" and reason is None and records:
        reason = f"non-finite training loss at step {steps}"
    return {
        "kind": "trial",
        "trial": name,
        "status": state,
        "steps": steps,
        "final_eval_loss": _finite(evals[-1] if evals else None),
        "best_eval_loss": min(finite) if finite else None,
        "final_train_loss": _finite(last.get("train_loss")),
        "final_eval_accuracy": _finite(accs[-1] if accs else None),
        "wall_sec": last.get("elapsed_sec"),
        "mode": status.get("mode"),
        "reason": reason,
        "overrides": overrides,
        "final_metrics": _step_metrics(cfg, last),
    }


def _step_metrics(cfg, last: dict) -> dict:
    """The last record's values of the step metrics the trial selected (``train.metrics``,
    ``attnlab.metrics``): ``name`` or ``name/...`` keys, as logged."""
    names = tuple((cfg or {}).get("train", {}).get("metrics") or ())
    return {
        k: v
        for k, v in last.items()
        if any(k == n or k.startswith(n + "/") or k.startswith(n + "_") for n in names)
    }


def _finite(x):
    """Non-finite losses become None (strict JSON has no NaN); the status says why."""
    return x if x is None or math.isfinite(x) else None


def _aggregate(rows: list[dict]) -> list[dict]:
    """Mean and standard deviation over ``train.seed`` of trials sharing other overrides."""
    if not any("train.seed" in r["overrides"] for r in rows):
        return []
    groups: dict[str, list[dict]] = {}
    for r in rows:
        rest = {k: v for k, v in r["overrides"].items() if k != "train.seed"}
        groups.setdefault(json.dumps(rest, sort_keys=True), []).append(r)
    out = []
    for key, members in groups.items():
        rest = json.loads(key)
        done = [m for m in members if m["status"] == "finished"]
        row = {
            "kind": "mean_over_seeds",
            "trial": ",".join(f"{k}={format_value(v)}" for k, v in sorted(rest.items())) or "base",
            "status": f"{len(done)}/{len(members)} finished",
            "seeds": len(done),
            "overrides": rest,
        }
        for field in (
            "final_eval_loss",
            "best_eval_loss",
            "final_train_loss",
            "final_eval_accuracy",
        ):
            values = [m[field] for m in done if m[field] is not None]
            row[field] = statistics.fmean(values) if values else None
            if field.endswith("eval_loss"):
                row[f"{field}_std"] = statistics.stdev(values) if len(values) > 1 else None
        out.append(row)
    return out


def collect(workdir) -> dict:
    """``{"keys", "trials", "aggregates"}`` of the sweep in ``workdir``, from its files."""
    root = pathlib.Path(workdir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    trials = _trials(root)
    if not trials:
        raise FileNotFoundError(f"{root} holds no sweep.json and no trial directories")
    rows = [_trial_row(root, name, overrides) for name, overrides in trials]
    keys = list(dict.fromkeys(k for r in rows for k in r["overrides"]))
    return {"keys": keys, "trials": rows, "aggregates": _aggregate(rows)}


def to_csv(results: dict) -> str:
    keys = results["keys"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[*TRIAL_FIELDS, *keys, "reason"], lineterminator="\n")
    writer.writeheader()
    for row in results["trials"] + results["aggregates"]:
        out = {f: _cell(row.get(f)) for f in (*TRIAL_FIELDS, "reason")}
        out.update({k: _cell(row["overrides"].get(k)) for k in keys})
        writer.writerow(out)
    return buf.getvalue()


def _cell(value) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def markdown_table(results: dict, digits: int = 4) -> str:
    """The results as a Markdown table (trials, then means over seeds when there are any)."""
    keys = results["keys"]
    acc = any(r.get("final_eval_accuracy") is not None for r in results["trials"])

    def num(x):
        return "" if x is None else f"{x:.{digits}f}"

    def row(cells):
        return "| " + " | ".join(cells) + " |"

    head = [*keys, "status", "steps", "final eval", "best eval", "final train"]
    head += ["final eval acc"] * acc + ["wall s"]
    lines = [row(head), "|" + "---|" * len(head)]
    for r in results["trials"]:
        cells = [format_value(r["overrides"][k]) if k in r["overrides"] else "" for k in keys]
        cells += [r["status"], str(r["steps"]), num(r["final_eval_loss"])]
        cells += [num(r["best_eval_loss"]), num(r["final_train_loss"])]
        cells += [num(r.get("final_eval_accuracy"))] * acc
        cells.append("" if r["wall_sec"] is None else f"{r['wall_sec']:.1f}")
        lines.append(row(cells))
    if results["aggregates"]:
        rest = [k for k in keys if k != "train.seed"]
        head = [*rest, "seeds", "final eval (mean ± std)", "best eval (mean ± std)"]
        head += ["final eval acc (mean)"] * acc
        lines += ["", row(head), "|" + "---|" * len(head)]
        for a in results["aggregates"]:
            cells = [format_value(a["overrides"][k]) if k in a["overrides"] else "" for k in rest]
            cells.append(str(a["seeds"]))
            for f in ("final_eval_loss", "best_eval_loss"):
                std = a.get(f"{f}_std")
                cells.append(num(a[f]) + ("" if std is None else f" ± {std:.{digits}f}"))
            cells += [num(a.get("final_eval_accuracy"))] * acc
            lines.append(row(cells))
    return "\n".join(lines) + "\n"


def collect_and_write(workdir) -> dict:
    """The sweep's results (``collect``) after writing them (``write_results``): how every
    way of running a sweep ends."""
    results = collect(workdir)
    write_results(workdir, results)
    return results


def write_results(workdir, results: dict) -> list[pathlib.Path]:
    """Writes results.json, results.csv and the two PNGs; returns their paths."""
    root = pathlib.Path(workdir)
    paths = [root / "results.json", root / "results.csv"]
    paths[0].write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    paths[1].write_text(to_csv(results))
    with_metrics = [r for r in results["trials"] if _metrics(root / r["trial"])]
    if with_metrics:
        from attnlab import viz

        fig = viz.plot_loss_curves(
            [root / r["trial"] for r in with_metrics],
            labels=[_short_label(r["overrides"]) or r["trial"] for r in with_metrics],
            title=f"sweep {root.name}",
        )
        ax = fig.axes[0]  # many trials: the legend goes beside the axes
        ax.legend(
            fontsize="x-small",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            ncol=1 if len(with_metrics) <= 10 else 2,
        )
        fig.set_size_inches(10 if len(with_metrics) <= 10 else 13, 5)
        fig.savefig(root / "loss_curves.png", dpi=110)
        paths.append(root / "loss_curves.png")
    fig = plot_final_metric(results)
    if fig is not None:
        fig.savefig(root / "final_metric.png", dpi=110)
        paths.append(root / "final_metric.png")
    return paths


def _short_label(overrides: dict) -> str:
    leaves = [k.rsplit(".", 1)[-1] for k in overrides]
    names = leaves if len(set(leaves)) == len(leaves) else list(overrides)
    return ",".join(
        f"{n}={format_value(v)}" for n, v in zip(names, overrides.values(), strict=True)
    )


def plot_final_metric(results: dict):
    """One panel per swept key: the final eval loss (train loss without evals) of the trials
    grouped by that key's value, as mean +- standard deviation over seeds and the other keys.

    Seeds are never an x axis (no line is drawn across seeds); a sweep over seeds alone shows
    each seed's point and their mean +- std band. Axes never use an offset.
    """
    from matplotlib.figure import Figure

    rows = [r for r in results["trials"] if r["status"] == "finished"]
    metric = "final_eval_loss" if any(r["final_eval_loss"] is not None for r in rows) else None
    metric = metric or "final_train_loss"
    rows = [r for r in rows if r[metric] is not None and math.isfinite(r[metric])]
    keys = [k for k in results["keys"] if k != "train.seed"] or results["keys"][:1]
    if not rows or not keys:
        return None
    fig = Figure(figsize=(4.2 * len(keys), 3.6), layout="constrained")
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=True):
        points = [(r["overrides"][key], r[metric]) for r in rows if key in r["overrides"]]
        labels = list(dict.fromkeys(format_value(x) for x, _ in points))
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x, _ in points)
        if key == "train.seed":  # seeds alone: points, and one band for their spread
            ys = [y for _, y in points]
            ax.scatter(range(len(ys)), ys, s=18, color="C0")
            mean, std = statistics.fmean(ys), statistics.stdev(ys) if len(ys) > 1 else 0.0
            ax.axhspan(mean - std, mean + std, color="C0", alpha=0.15, label="mean +- std")
            ax.axhline(mean, color="C0", lw=1)
            ax.set_xticks(range(len(ys)), labels)
            ax.legend(fontsize="x-small")
        else:
            given = {format_value(x): x for x, _ in points}
            order = sorted(labels, key=lambda s: float(given[s])) if numeric else labels
            pos = [float(given[s]) for s in order] if numeric else list(range(len(order)))
            groups = [[y for x, y in points if format_value(x) == s] for s in order]
            means = [statistics.fmean(g) for g in groups]
            stds = [statistics.stdev(g) if len(g) > 1 else 0.0 for g in groups]
            for p, g in zip(pos, groups, strict=True):
                ax.scatter([p] * len(g), g, s=10, color="0.55", zorder=2)
            ax.errorbar(pos, means, yerr=stds, fmt="o-", color="C0", capsize=3, zorder=3)
            lo = [m - s for m, s in zip(means, stds, strict=True)]
            hi = [m + s for m, s in zip(means, stds, strict=True)]
            ax.fill_between(pos, lo, hi, color="C0", alpha=0.15, lw=0)
            if numeric and key.rsplit(".", 1)[-1] in LOG_X_LEAVES and min(pos) > 0:
                ax.set_xscale("log")
            if len(pos) <= 12:  # label the swept values themselves
                ax.set_xticks(pos, order, rotation=0 if numeric else 30)
                ax.minorticks_off()
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.set_xlabel(key)
        ax.set_ylabel(metric.replace("_", " ") + " (mean +- std)")
        ax.grid(alpha=0.3)
    return fig
