"""The ablation's table and figures from its work directories (``ROW_seedS/results.json``).

Rows (LoLCATs' ablation at our scale, then the hybrids):

- ``swap + finetune``: the linear student (``window=0``) without stage 1, its adapters
  trained for the tokens of both stages (``linear``'s ``swap_only``; the feature maps too
  where it ran with ``swap_trains="lora+mixer"``);
- ``+ attention transfer``: the same student after stage 1, then LoRA (``linear``);
- ``+ sliding window``: LoLCATs' mixer with its window (``window``), and beside it the
  same mixer swapped in without stage 1 (``window``'s ``swap_only``, where it ran);
- ``hybrid 1/4`` and ``hybrid 1/2``: a quarter or half of the layers kept as softmax
  attention, the rest linear, with both stages; ``teacher``.

Each cell is the mean over seeds with a 95% t-interval (``± half-width``; one seed: the
value alone). ``report(dir)`` writes ``dir/ablation.md``, ``dir/ablation.json``,
``dir/stage1_mse.png`` (each replaced layer's attention MSE during stage 1, one run) and
``dir/gap_per_task.png`` (teacher minus student per task: eval loss, passkey).
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics

from attnlab.experiment.harness import interval

ROWS = [
    ("swap + finetune", "linear", "swap_only_eval_loss"),
    ("+ attention transfer", "linear", "student_eval_loss"),
    ("+ sliding window", "window", "student_eval_loss"),
    ("swap + finetune, with the window", "window", "swap_only_eval_loss"),
    ("hybrid 1/2 softmax", "hybrid_half", "student_eval_loss"),
    ("hybrid 1/4 softmax", "hybrid_quarter", "student_eval_loss"),
    ("teacher", "window", "teacher_eval_loss"),
]


def load(directory: pathlib.Path) -> dict:
    """``{row: {seed: results}}`` of every finished run under ``directory``."""
    out: dict = {}
    for f in sorted(directory.glob("*_seed*/results.json")):
        row, seed = f.parent.name.rsplit("_seed", 1)
        out.setdefault(row, {})[int(seed)] = json.loads(f.read_text())
    return out


def table(runs: dict) -> list[dict]:
    rows = []
    teacher = [r["teacher_eval_loss"] for rr in runs.values() for r in rr.values()]
    t_mean = statistics.fmean(teacher) if teacher else math.nan
    for label, row, key in ROWS:
        values = [r[key] for r in runs.get(row, {}).values() if key in r]
        mean, half, n = interval(values)
        pk = "teacher" if key == "teacher_eval_loss" else "student"
        passkey = [r["passkey"][pk] for r in runs.get(row, {}).values() if r.get("passkey")]
        if key == "swap_only_eval_loss":
            passkey = []
        rows.append({"row": label, "eval_loss": mean, "ci95": half, "seeds": n,
                     "gap": mean - t_mean, "passkey": interval(passkey)[0]})  # fmt: skip
    return rows


def markdown(rows) -> str:
    lines = ["| row | eval loss (nats) | gap to teacher | passkey digits | seeds |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if not r["seeds"]:
            continue
        ci = f" ± {r['ci95']:.3f}" if r["seeds"] > 1 else ""
        pk = "" if math.isnan(r["passkey"]) else f"{r['passkey']:.2f}"
        lines.append(f"| {r['row']} | {r['eval_loss']:.3f}{ci} | {r['gap']:+.3f} | {pk} | "
                     f"{r['seeds']} |")  # fmt: skip
    return "\n".join(lines)


def plot_stage1(run_dir: pathlib.Path, out: pathlib.Path):
    """Each replaced layer's attention MSE against the stage-1 step (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in (run_dir / "stage1" / "metrics.jsonl").read_text().splitlines()]
    layers = json.loads((run_dir / "results.json").read_text())["layers"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    steps = [r["step"] for r in recs]
    for j, layer in enumerate(sorted(layers, key=int)):
        ax.plot(steps, [r["attention_mse"][j] for r in recs], label=f"layer {layer}")
    ax.set(yscale="log", xlabel="stage-1 step", ylabel="attention-output MSE",
           title=f"attention transfer ({run_dir.name})")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_gap(runs: dict, out: pathlib.Path):
    """Teacher minus student per task and row: eval loss (nats, student - teacher) and
    passkey digit accuracy (teacher - student)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("linear", "window", "hybrid_quarter", "hybrid_half") if n in runs]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, (task, f) in zip(axes, [
        ("eval loss gap (nats)", lambda r: r["student_eval_loss"] - r["teacher_eval_loss"]),
        ("passkey gap (digits)",
         lambda r: r["passkey"]["teacher"] - r["passkey"]["student"] if r.get("passkey") else None),
    ], strict=True):  # fmt: skip
        means = [interval([v for r in runs[n].values() if (v := f(r)) is not None]) for n in names]
        ax.bar(names, [m[0] for m in means], yerr=[m[1] for m in means], capsize=3)
        ax.set_title(task, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def report(directory: pathlib.Path) -> str:
    """Writes the table and figures (module docstring); returns the markdown table."""
    runs = load(directory)
    rows = table(runs)
    md = markdown(rows)
    (directory / "ablation.md").write_text(md + "\n")
    (directory / "ablation.json").write_text(json.dumps(rows, indent=1))
    first = next(iter(sorted(directory.glob("window_seed*/results.json"))), None)
    if first is not None:
        plot_stage1(first.parent, directory / "stage1_mse.png")
    if runs:
        plot_gap(runs, directory / "gap_per_task.png")
    return md
