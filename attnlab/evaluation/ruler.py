"""RULER-style task accuracy by length, and the effective length.

``evaluate_tasks(scorable, tasks, lengths)`` draws ``examples`` instances of each task at
each length (``attnlab.data.ruler_tasks``, seeded, haystacks from the embedded corpus),
decodes each prompt greedily through the KV cache (``attnlab.generate``, batched, long
prompts prefilled in chunks), cuts the output at its first newline and scores the fraction
of references it contains. A task that cannot fit a length scores None there.

The effective length (RULER) is the longest length up to which the mean accuracy over the
tasks stays at or above ``threshold`` (0.856, Llama 2 7B's mean at 4k in RULER) at every
length; None where the shortest length already falls below it.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from flax import nnx

from attnlab.data import ruler_tasks
from attnlab.errors import ConfigError

THRESHOLD = 0.856
_LINES = {}


def haystack_lines(max_chars=400_000) -> list[str]:
    """Lines of the embedded corpus used as real-text haystack."""
    if max_chars not in _LINES:
        from attnlab.data.corpus import stdlib_corpus

        _LINES[max_chars] = ruler_tasks.corpus_lines(stdlib_corpus(None)[-max_chars:])
    return _LINES[max_chars]


def greedy(model, prompts, max_new_tokens, *, rows=8, prefill_chunk=512) -> list[list[int]]:
    """Greedy continuations (new ids) of ``prompts``, ``rows`` at a time through the cache."""
    from attnlab.decode import generate

    out = []
    for first in range(0, len(prompts), rows):
        group = prompts[first : first + rows]
        lengths = np.array([len(p) for p in group] + [len(group[0])] * (rows - len(group)))
        ids = np.zeros((rows, int(lengths.max())), np.int32)
        for r, p in enumerate(group):
            ids[r, : len(p)] = p
        for r in range(len(group), rows):  # rows that fill the batch repeat the first
            ids[r, : len(group[0])] = group[0]
        chunk = prefill_chunk if ids.shape[1] > prefill_chunk else None
        result = generate(
            model,
            ids,
            max_new_tokens,
            prompt_lengths=lengths,
            on_overflow="stop",
            prefill_chunk=chunk,
        )
        out += [result.tokens[r, : result.lengths[r]].tolist() for r in range(len(group))]
    return out


def task_accuracy(generate, decode, examples) -> tuple[float, list[str]]:
    """Mean score of ``examples`` (``ruler_tasks.Example``) and the predictions:
    ``generate(prompts, max_new_tokens)`` gives each prompt's new ids (``greedy``), cut at
    their first newline once decoded."""
    new = max(len(e.target) for e in examples) + 2
    outputs = generate([e.prompt for e in examples], new)
    predictions = [decode(o).split("\n")[0] for o in outputs]
    scores = [
        ruler_tasks.score(p, e.references) for p, e in zip(predictions, examples, strict=True)
    ]
    return float(np.mean(scores)), predictions


def effective_length(table: dict, lengths, threshold=THRESHOLD):
    """The longest length up to which every length's mean over tasks is >= ``threshold``."""
    best = None
    for n in sorted(lengths):
        scores = [v[str(n)] for v in table.values() if v.get(str(n)) is not None]
        if not scores or np.mean(scores) < threshold:
            break
        best = n
    return best


def evaluate_tasks(
    scorable,
    tasks,
    lengths,
    *,
    examples=32,
    seed=0,
    threshold=THRESHOLD,
    rows=None,
    progress=False,
    lines=None,
) -> dict:
    """``{"name", "lengths", "accuracy": {task: {length: acc | None}}, "mean": {length: m},
    "effective_length", "threshold", "examples", "seed", "seconds"}``."""
    from attnlab.evaluation.length import check_lengths, eval_config, merged

    names = ruler_tasks.task_names(tasks)
    lengths = sorted(int(n) for n in lengths)
    check_lengths(scorable, lengths)
    if scorable.encode is None:
        raise ConfigError(f"{scorable.name}: no text tokenizer; --tasks needs one")
    lines = haystack_lines() if lines is None else lines
    longest = max(lengths) + 64  # room for the answer (generation stops at the limit)
    cfg = eval_config(scorable, longest if scorable.limit is None else min(longest, scorable.limit))
    graphdef, state = merged(cfg, scorable.state)
    model = nnx.merge(graphdef, state)
    table, began = {t: {} for t in names}, time.perf_counter()
    for n in lengths:
        for t in names:
            try:
                exs = ruler_tasks.examples(
                    t, n, examples, scorable.encode, seed=seed, corpus_lines=lines
                )
            except ConfigError:
                table[t][str(n)] = None  # the task does not fit this length
                continue
            except ValueError as e:  # a character the tokenizer lacks
                raise ConfigError(f"--tasks {t}: {e}") from None
            B = rows or max(1, min(examples, 8192 // n))
            acc, _ = task_accuracy(
                lambda p, k, B=B: greedy(model, p, k, rows=B), scorable.decode, exs
            )
            table[t][str(n)] = acc
            if progress:
                print(f"  {t} at {n}: {acc:.3f}", file=sys.stderr, flush=True)
    mean = {}
    for n in lengths:
        got = [v[str(n)] for v in table.values() if v[str(n)] is not None]
        mean[str(n)] = float(np.mean(got)) if got else None
    return {
        "name": scorable.name,
        "lengths": lengths,
        "accuracy": table,
        "mean": mean,
        "effective_length": effective_length(table, lengths, threshold),
        "threshold": threshold,
        "examples": examples,
        "seed": seed,
        "seconds": round(time.perf_counter() - began, 2),
    }


def plot_heatmap(result: dict, path, *, title=None):
    """Accuracy as a task x length heat map (blank where a task does not fit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks, lengths = list(result["accuracy"]), result["lengths"]
    grid = np.array(
        [
            [
                np.nan
                if result["accuracy"][t].get(str(n)) is None
                else result["accuracy"][t][str(n)]
                for n in lengths
            ]
            for t in tasks
        ]
    )
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(lengths), 0.9 + 0.42 * len(tasks)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for i in range(len(tasks)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(
                    j,
                    i,
                    f"{grid[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="w" if grid[i, j] < 0.6 else "k",
                )
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(tasks)), tasks)
    ax.set_xlabel("length (tokens)")
    eff = result.get("effective_length")
    ax.set_title((title or "task accuracy") + f"\neffective length: {eff}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
