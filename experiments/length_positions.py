"""Train short, test long: one decoder, six position encodings, perplexity to 16x its length.

ALiBi's experiment (Press et al. 2022, "Train Short, Test Long") at CPU scale: the same
character-level decoder on the embedded corpus (the Python standard library's source), trained
at T = 128 with each of attnlab's ``ModelConfig.position`` kinds (learned absolute,
sinusoidal, RoPE, T5's relative buckets, ALiBi, none) and three seeds (the sweep trains a
kind's seeds together, vmapped), then scored by ``attnlab eval
--lengths`` at 128 .. 2048 tokens on non-overlapping windows (``chunks``) and with a sliding
window (``sliding``: every scored token sees the full window behind it). RoPE is scored
again with Position Interpolation and YaRN applied at evaluation time (``--rope-scaling``)::

    attnlab sweep --config experiments/length_positions.py --workdir runs/length_positions
    python experiments/length_positions.py --report runs/length_positions

``model.max_len`` is 2048 so that the learned table has rows to evaluate at (those past 128
are never trained); the other kinds hold nothing that depends on it. ``--report`` writes
``DIR/length_table.md`` (each cell the mean over seeds ± its 95% t-interval),
``DIR/length_eval.json`` (``mean`` and ``per_seed``) and ``DIR/length_eval_<mode>.png`` (one
line per position kind, with error bars). docs/length.md has the figures.

Measured on the 2 CPU cores, shared with other training: the sweep (three seeds of each kind)
17 min wall (9.2 min CPU), the report with ``--tokens 8192`` 10 min wall (5.3 min CPU). Loss
at 128 -> 2048 tokens, non-overlapping windows, mean over the seeds ± 95% half-width: ALiBi
1.754 ± 0.099 -> 1.748 ± 0.102 (flat in each seed), NoPE 2.025 -> 2.112, T5 bias 1.944 ->
2.135, learned 2.027 -> 2.353, sinusoidal 2.480 -> 3.107, RoPE 1.618 -> 2.682 ± 0.871 (rising
in each seed), RoPE with YaRN x16 1.950 -> 2.560, with Position Interpolation x16 2.843 ->
2.957.
"""

from __future__ import annotations

import json
import pathlib

from attnlab.experiment import base_config
from attnlab.experiment.harness import eval_at_end, finished_trials, report_main, tiny_twin
from attnlab.experiment.presets import STUDY_DECODER, STUDY_TRAINING

VARIANTS = ("tiny",)
POSITIONS = ("learned", "sinusoidal", "rope", "relative", "alibi", "none")
TRAIN_LEN = 128
LENGTHS = (128, 256, 512, 1024, 2048)
SCALINGS = ("linear:16", "yarn:16")  # evaluation-time RoPE scalings beside plain RoPE
SEEDS = (0, 1, 2)


def get_config(variant=None):
    c = base_config()
    c.name = "length_positions"
    c.model.update(STUDY_DECODER, max_len=max(LENGTHS), attention_impl="chunked")
    c.update(STUDY_TRAINING)
    c.data.seq_len = TRAIN_LEN
    eval_at_end(c, steps=300, batch_size=16, log_every_steps=50, eval_batches=4, seed=0)
    if variant == "tiny":
        tiny_twin(c, d_model=16, d_ff=32, max_len=64, seq_len=16, max_chars=20_000, steps=2,
                  batch_size=2)  # fmt: skip
    return c


def sweep(variant=None):
    """One trial per position kind and seed."""
    from attnlab.sweep import grid

    return grid({"model.position": list(POSITIONS), "train.seed": list(SEEDS)})


def lengths_of(variant=None) -> list[int]:
    if variant == "tiny":
        return [16, 32, 64]
    return list(LENGTHS)


def report(root, *, variant=None, tokens=16_384, modes=("chunks", "sliding")) -> dict:
    """Scores every finished trial under ``root`` at ``lengths_of(variant)`` in ``modes``
    (RoPE also with ``SCALINGS``), each position kind's seeds averaged; writes the table, JSON
    and one PNG per mode."""
    from attnlab.evaluation import length

    root = pathlib.Path(root)
    lengths = lengths_of(variant)
    per_seed = {}
    for trial, config in finished_trials(root):
        position, seed = config["model"]["position"], int(config["train"]["seed"])
        scalings = [None, *SCALINGS] if position == "rope" else [None]
        for scaling in scalings:
            name = position if scaling is None else f"rope+{scaling.split(':')[0]}"
            per_seed.setdefault(name, {})[seed] = length.evaluate_lengths(
                length.from_workdir(trial, rope_scaling=scaling),
                lengths,
                modes=modes,
                tokens=tokens,
                progress=True,
            )
    results = {
        name: length.mean_over_seeds([by_seed[s] for s in sorted(by_seed)])
        for name, by_seed in per_seed.items()
    }
    saved = {"mean": results, "per_seed": per_seed}
    (root / "length_eval.json").write_text(json.dumps(saved, indent=1))
    for mode in modes:
        length.plot_lengths(results, mode, root / f"length_eval_{mode}.png")
    (root / "length_table.md").write_text(length.markdown_table(results, modes))
    return results


def main(argv=None):
    report_main(report, __doc__, VARIANTS, "length_table.md", argv,
                tokens=(16_384, "tokens scored per length"))  # fmt: skip


if __name__ == "__main__":
    main()
