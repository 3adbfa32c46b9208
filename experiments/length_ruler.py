"""RULER at CPU scale: the effective length of attention, a sliding window, GDN, Mamba-2 and a
hybrid, each trained alike on the tasks at 192 characters and scored to 8x that.

RULER (Hsieh et al. 2024) asks a model to find needles, track variables and pick out common
words at growing lengths; its effective length is the longest length at which the mean
accuracy stays above 85.6%. Here each row of ``ROWS`` (2 layers, d_model 64, no position
encoding) learns ``TRAIN_TASKS`` from ``data.kind="length_task"`` (character tokens of the
embedded corpus, rows of 97..193 tokens, the loss on the answer), then ``--report`` runs
``attnlab eval --tasks`` on every trial (greedy decoding through the cache, 16 examples per
task and length)::

    attnlab sweep --config experiments/length_ruler.py --workdir runs/length_ruler
    python experiments/length_ruler.py --report runs/length_ruler

It writes ``DIR/ruler.json``, ``DIR/ruler.md`` (the mean accuracy per length and the
effective length per row) and ``DIR/tasks_<row>.png`` (task x length heat maps).
docs/length.md has the figures. What one would expect from the mechanisms: a fixed-size
state (GDN, Mamba-2) or a window (sliding) holds less as the haystack grows, so those rows
should fall first; attention with no positions reads the whole context at any length.

Measured on 2 shared CPU cores (load average 13-20): the sweep 31 min wall; at 250 steps
every row scores 0 at every length. Every row trained on to 2,400 steps (a constant
learning rate: resumed and direct runs follow the same path), mean accuracy at 192 / 384 /
768 / 1536: the hybrid 0.938 / 0.706 / 0.656 / 0.563 (effective length 192; passkey 1.0
throughout, niah_single 1.0 to 768), GDN 0.344 / 0.219 / 0.094 / 0.094 (passkey 1.0 at
192, 0.25 at 768), attention 0.250 / 0.156 / 0.063 / 0.0, the sliding window and Mamba-2
(which learned none of the tasks) 0 throughout.
"""

from __future__ import annotations

import json
import pathlib

from attnlab.experiment import base_config, flat_keys
from attnlab.experiment.harness import eval_at_end, finished_trials, report_main, tiny_twin
from attnlab.experiment.presets import EMBEDDED_CHARS, STUDY_DECODER

VARIANTS = ("tiny",)
TRAIN_LEN = 192
LENGTHS = (192, 384, 768, 1536)
TRAIN_TASKS = ("niah_single", "niah_single_needles", "passkey", "vt")
EVAL_TASKS = TRAIN_TASKS
WINDOW = 64
MAMBA2 = {"mixer": "mamba2", "mixer_settings": {"state_size": 16}}  # Zoology's state size
ROWS = {
    "attention": {"mixer": "mha"},
    "sliding": {"mixer": "mha", "sliding_window": WINDOW},
    "gdn": {"mixer": "gated_deltanet"},
    "mamba2": {"mixer": "mamba2", "block_pattern": {"block": (MAMBA2,)}},
    "hybrid": {"block_pattern": {"block": ("gated_deltanet", "mha")}},
}  # fmt: skip


def get_config(variant=None):
    c = base_config()
    c.name = "length_ruler"
    c.model.update(STUDY_DECODER, max_len=TRAIN_LEN, position="none", tie_embeddings=False,
                   embed_scale=True, init_std=64**-0.5)  # fmt: skip
    c.data.update(EMBEDDED_CHARS, kind="length_task", tasks=",".join(TRAIN_TASKS),
                  seq_len=TRAIN_LEN, max_chars=1_000_000)  # fmt: skip
    c.optim.update(learning_rate=2e-3, warmup_steps=30, schedule="constant", weight_decay=0.0)
    eval_at_end(c, steps=250, batch_size=16, log_every_steps=50, eval_batches=1, seed=0)
    if variant == "tiny":  # both layers kept
        tiny_twin(c, d_model=16, n_layers=2, d_ff=32, max_len=128, seq_len=128, steps=2,
                  batch_size=2)  # fmt: skip
        c.data.tasks = "passkey"
    return c


def sweep(variant=None):
    """One trial per row."""
    names = ("attention", "gdn") if variant == "tiny" else tuple(ROWS)
    return [flat_keys(ROWS[n], "model.") for n in names]


def row_of(model: dict) -> str:
    blocks = (model.get("block_pattern") or {}).get("block") or ()
    if len(blocks) == 2:
        return "hybrid"
    if blocks:
        return "mamba2"
    if model.get("mixer") == "gated_deltanet":
        return "gdn"
    return "sliding" if model.get("sliding_window") else "attention"


def report(root, *, variant=None, examples=16) -> dict:
    """Scores every finished trial under ``root`` on ``EVAL_TASKS`` at ``LENGTHS``."""
    from attnlab.evaluation import length, ruler

    root = pathlib.Path(root)
    tiny = variant == "tiny"
    lengths, tasks = ((128, 256), ("passkey",)) if tiny else (LENGTHS, EVAL_TASKS)
    results = {}
    for trial, config in finished_trials(root):
        name = row_of(config["model"])
        results[name] = ruler.evaluate_tasks(
            length.from_workdir(trial), tasks, lengths, examples=examples, progress=True
        )
        ruler.plot_heatmap(results[name], root / f"tasks_{name}.png", title=name)
    (root / "ruler.json").write_text(json.dumps(results, indent=1))
    head = "| row | " + " | ".join(map(str, lengths)) + " | effective length |"
    lines = [head, "|---|" + "---|" * (len(lengths) + 1)]
    for name, r in results.items():
        cells = [f"{r['mean'][str(n)]:.3f}" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['effective_length']} |")
    (root / "ruler.md").write_text("\n".join(lines) + "\n")
    return results


def main(argv=None):
    report_main(report, __doc__, VARIANTS, "ruler.md", argv,
                examples=(16, "examples per task and length"))  # fmt: skip


if __name__ == "__main__":
    main()
