"""Length generalisation on algorithmic tasks by position encoding (NoPE's experiment).

Kazemnejad et al. (2023) trained decoders on task instances of length <= 20 and tested them
to 40: no position encoding generalised best, then T5's bias, ALiBi, RoPE, absolute positions
last. Here one small decoder per position kind learns copy, reverse, sort, addition, parity
and summation together (``data.kind="length_task"``; a marker symbol names each row's task)
at problem lengths 1..20, and ``--report`` scores exact match (teacher-forced argmax over the
answer: what greedy decoding writes) at lengths 5..40 on 128 fresh rows per task and length::

    attnlab sweep --config experiments/length_nope.py --workdir runs/length_nope
    python experiments/length_nope.py --report runs/length_nope

``model.max_len`` (128) covers a 40-digit addition row; the learned table's rows past a
20-length row are never trained. The report writes ``DIR/nope.json``, ``DIR/nope.md`` (per
task: accuracy in distribution, mean over 21..40) and ``DIR/nope.png``. docs/length.md has
the figures.

Measured on 2 shared CPU cores (load average 15-20): the sweep 25 min wall (about 3 min per
trial), the report 7 min. At 400 steps no task is solved in distribution (exact match 0 on
copy, reverse and addition; chance on parity and summation); mean per-token accuracy past
length 20: T5 bias 0.378, NoPE 0.370, learned 0.329, RoPE 0.319, ALiBi 0.318, sinusoidal
0.095.

The ``per_task`` variant asks the paper's question of models that solve the tasks first: one
model per task and position kind (copy, reverse, sort, addition with its sum written
least-significant digit first, parity), trained at problem lengths 1..10 with a cosine
schedule and tested to 20, the paper's 2x at a length these models learn on a CPU::

    attnlab sweep --config experiments/length_nope.py:per_task --workdir runs/length_nope_tasks
    python experiments/length_nope.py --report runs/length_nope_tasks --variant per_task

Measured (two seeds, 5,000 steps; 1.5-2 min a trial on the 2 CPU cores, two at once): copy,
reverse and sort are solved in distribution by most kinds, addition and parity by none.
Exact match past length 10: NoPE sorts 0.98; ALiBi copies 0.21 and sorts 0.35 (to 12-14);
RoPE sorts 0.10; learned and sinusoidal 0 on every task. Mean reciprocal rank over copy,
reverse and sort: ALiBi 0.83, NoPE 0.56, T5 bias 0.42, RoPE 0.31, learned and sinusoidal 0.26.
"""

from __future__ import annotations

import json
import pathlib

from attnlab.data import length_tasks
from attnlab.experiment import base_config
from attnlab.experiment.harness import eval_at_end, finished_trials, report_main, tiny_twin
from attnlab.experiment.presets import STUDY_DECODER

VARIANTS = ("tiny", "per_task", "per_task_tiny")
POSITIONS = ("learned", "sinusoidal", "rope", "relative", "alibi", "none")
TASKS = ("copy", "reverse", "sort", "addition", "parity", "summation")
TRAIN_MAX, TEST_MAX = 20, 40
NUM_SYMBOLS = 16
# The per-task study: one task a model, at problem lengths up to PER_TASK_MAX.
PER_TASK = ("copy", "reverse", "sort", "addition", "parity")
PER_TASK_MAX = 10
PER_TASK_SEEDS = (0, 1)


def get_config(variant=None):
    c = base_config()
    c.name = "length_nope"
    c.model.update(STUDY_DECODER, vocab_size=length_tasks.vocab_size(NUM_SYMBOLS), max_len=128,
                   position="none")  # fmt: skip
    seq_len = max(length_tasks.row_len(t, TRAIN_MAX) for t in TASKS) - 1
    c.data.update(
        kind="length_task",
        tasks=",".join(TASKS),
        seq_len=seq_len,
        num_symbols=NUM_SYMBOLS,
        min_len=1,
        max_len=TRAIN_MAX,
    )
    c.optim.update(learning_rate=3e-3, warmup_steps=50, weight_decay=0.0, schedule="constant")
    eval_at_end(c, steps=400, batch_size=32, log_every_steps=100, eval_batches=2, seed=0)
    if variant in ("per_task", "per_task_tiny"):  # the sweep sets data.tasks and data.seq_len
        c.name = "length_nope_per_task"
        c.data.update(tasks=PER_TASK[0], seq_len=_per_task_seq_len(PER_TASK[0], PER_TASK_MAX),
                      max_len=PER_TASK_MAX, reverse_sum=True)  # fmt: skip
        c.optim.update(schedule="cosine")
        eval_at_end(c, steps=5000, batch_size=32, log_every_steps=500, eval_batches=2, seed=0)
    if variant in ("tiny", "per_task_tiny"):
        tiny_twin(c, d_model=16, d_ff=32, max_len=64, steps=2,
                  seq_len=length_tasks.row_len("addition", 4) - 1)  # fmt: skip
        c.data.max_len = 4
    return c


def _per_task_seq_len(task, train_max):
    return length_tasks.row_len(task, train_max) - 1


def _train_max(variant):
    return {"tiny": 4, "per_task_tiny": 4, "per_task": PER_TASK_MAX}.get(variant, TRAIN_MAX)


def sweep(variant=None):
    """One trial per position kind (``per_task``: per position kind and task, each task's rows
    as long as its longest problem)."""
    from attnlab.sweep import grid, product

    positions = grid({"model.position": list(POSITIONS)})
    if variant not in ("per_task", "per_task_tiny"):
        return positions
    # Sinusoidal as Vaswani et al. add it: to token embeddings scaled by sqrt(d_model), which
    # the table's unit amplitude otherwise swamps (token embeddings start at std 0.02).
    positions.append({"model.position": "sinusoidal", "model.embed_scale": True})
    n = _train_max(variant)
    tasks = [{"data.tasks": t, "data.seq_len": _per_task_seq_len(t, n)} for t in PER_TASK]
    return product(positions, tasks, grid({"train.seed": list(PER_TASK_SEEDS)}))


def lengths_of(variant=None):
    """The problem lengths scored: to twice the longest trained."""
    n = _train_max(variant)
    step = max(2, n // 4)
    return list(range(step, 2 * n + 1, step))


def score_run(workdir, lengths, rows=128) -> dict:
    """``{"exact_match": {task: {length: v}}, "token_accuracy": ...}`` of the run in
    ``workdir``, loaded and compiled once: the fraction of rows whose answer is all right, and
    of answer tokens right."""
    import jax
    import jax.numpy as jnp

    from attnlab import runs

    run = runs.load_run(workdir)
    d, mcfg = run.config.data, run.trainer.mcfg
    fn = jax.jit(lambda p, x: jnp.argmax(run.trainer.model(p)(x).logits, -1))
    out = {"exact_match": {}, "token_accuracy": {}}
    for task in str(d.tasks).split(","):
        seq_len = max(length_tasks.row_len(task, max(lengths)) - 1, int(d.seq_len))
        if seq_len > mcfg.max_len:
            raise ValueError(f"{task} at {max(lengths)} needs max_len {seq_len}")
        for kind, per_token in (("exact_match", False), ("token_accuracy", True)):
            out[kind][task] = {
                n: length_tasks.teacher_forced_accuracy(
                    lambda x: fn(run.params, x),
                    task,
                    n,
                    rows=rows,
                    seq_len=seq_len,
                    num_symbols=int(d.num_symbols),
                    per_token=per_token,
                    reverse_sum=bool(d.get("reverse_sum", False)),
                )
                for n in lengths
            }
    return out


def _row_order(position: str):
    base = position.split(" ")[0]
    return POSITIONS.index(base) if base in POSITIONS else len(POSITIONS), position


def _mean_over_seeds(by_position) -> dict:
    """``{position: {seed: {task: {length: v}}}}`` -> ``{position: {task: {length: mean}}}``
    over the seeds that trained that task."""
    out = {}
    for position, by_seed in by_position.items():
        tasks = {t for scores in by_seed.values() for t in scores}
        out[position] = {}
        for t in sorted(tasks, key=TASKS.index):
            seeds = [scores[t] for scores in by_seed.values() if t in scores]
            out[position][t] = {n: sum(s[n] for s in seeds) / len(seeds) for n in seeds[0]}
    return out


def reciprocal_ranks(results, train_max, tasks=None) -> dict:
    """Kazemnejad et al.'s summary: per task (``tasks``, default all), the position kinds
    ranked by their mean score past ``train_max`` (ties share the better rank);
    ``{position: mean of 1 / rank}``."""
    beyond = {
        pos: {t: _mean([v for n, v in by_n.items() if n > train_max]) for t, by_n in by.items()}
        for pos, by in results.items()
    }
    tasks = sorted(tasks or {t for by_task in beyond.values() for t in by_task})
    ranks = {pos: [] for pos in beyond}
    for t in tasks:
        scores = {pos: by_task[t] for pos, by_task in beyond.items() if t in by_task}
        for pos, v in scores.items():
            ranks[pos].append(1.0 / (1 + sum(w > v for w in scores.values())))
    return {pos: _mean(r) for pos, r in ranks.items()}


def _mean(values):
    return sum(values) / len(values)


def solved_tasks(results, train_max, at=0.9) -> list[str]:
    """The tasks some position kind solves at the trained lengths (mean score >= ``at``)."""
    tasks = {t for by_task in results.values() for t in by_task}
    return sorted(
        t
        for t in tasks
        if max(
            _mean([v for n, v in by_task[t].items() if n <= train_max])
            for by_task in results.values()
            if t in by_task
        )
        >= at
    )


def _table(results, train_max) -> str:
    tasks = list(next(iter(results.values())))
    solved = solved_tasks(results, train_max)
    mrr = reciprocal_ranks(results, train_max, solved) if solved else {}
    head = " | ".join(f"{t} ≤{train_max} / >{train_max}" for t in tasks)
    lines = [f"| position | {head} | mean >{train_max} | MRR ({', '.join(solved)}) |"]
    lines.append("|---|" + "---|" * (len(tasks) + 2))
    for pos, by_task in results.items():
        cells, beyond = [], []
        for t in tasks:
            inside = [v for n, v in by_task[t].items() if n <= train_max]
            out = [v for n, v in by_task[t].items() if n > train_max]
            beyond += out
            cells.append(f"{_mean(inside):.2f} / {_mean(out):.2f}")
        lines.append(f"| {pos} | " + " | ".join(cells) + f" | {_mean(beyond):.3f} | "
                     f"{mrr.get(pos, float('nan')):.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def report(root, *, variant=None, rows=128) -> dict:
    """Scores every finished trial under ``root`` (exact match and per-token accuracy), each
    cell the mean over the seeds trained; writes nope.json (the means, ``per_seed``), nope.md
    (both tables) and nope.png / nope_tokens.png."""
    root = pathlib.Path(root)
    lengths = lengths_of(variant)
    train_max = _train_max(variant)
    per_seed = {"exact_match": {}, "token_accuracy": {}}
    for trial, config in finished_trials(root):  # per_task: one task a trial, merged
        position = config["model"]["position"] + " x sqrt(d)" * config["model"]["embed_scale"]
        seed = int(config["train"]["seed"])
        for kind, scores in score_run(trial, lengths, rows).items():
            per_seed[kind].setdefault(position, {}).setdefault(seed, {}).update(scores)
    for kind, by_position in per_seed.items():  # rows in POSITIONS' order
        per_seed[kind] = {p: by_position[p] for p in sorted(by_position, key=_row_order)}
    results = {kind: _mean_over_seeds(by_position) for kind, by_position in per_seed.items()}
    (root / "nope.json").write_text(json.dumps(results | {"per_seed": per_seed}, indent=1))
    text = "exact match\n\n" + _table(results["exact_match"], train_max)
    text += "\nper-token accuracy\n\n" + _table(results["token_accuracy"], train_max)
    (root / "nope.md").write_text(text)
    _plot(results["exact_match"], lengths, train_max, root / "nope.png", "exact match")
    _plot(results["token_accuracy"], lengths, train_max, root / "nope_tokens.png", "token acc.")
    return results


def _plot(results, lengths, train_max, path, ylabel):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(next(iter(results.values())))
    fig, axes = plt.subplots(1, len(tasks), figsize=(2.6 * len(tasks), 2.8), sharey=True)
    for ax, t in zip(axes, tasks, strict=True):
        for pos, by_task in results.items():
            ax.plot(lengths, [by_task[t][n] for n in lengths], "o-", ms=3, label=pos)
        ax.axvline(train_max, color="grey", ls=":", lw=1)
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("problem length")
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    report_main(report, __doc__, VARIANTS, "nope.md", argv,
                rows=(128, "fresh rows per task and length"))  # fmt: skip


if __name__ == "__main__":
    main()
