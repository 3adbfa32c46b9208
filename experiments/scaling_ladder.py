"""A scaling ladder on tiny Shakespeare: three compute budgets, IsoFLOP curves, Chinchilla's
fits, a prediction for a budget 3x the largest, and the run that checks it, for two
variants side by side: two peak learning rates (1e-2, the best at the base width, and 2.5e-3).
Variants that differ only in values the train state holds train as one stacked program per
rung, which halves the programs this CPU compiles; any overrides work as variants
(``{"model.position": "learned"}``...), each then its own program.

The size dial is the width (``model.d_model``, two layers); the models are in muP relative
to ``base_width`` 32, so one learning rate serves every size. ``LADDER`` holds the budgets
(FLOPs, ``C = 6 N D``), the sizes, the variants and the target budget; ``sweep()`` is the
ladder's trials (``attnlab.sweep.scaling.plan_ladder``), so ``attnlab sweep`` trains it too.

``python experiments/scaling_ladder.py --workdir runs/ladder`` trains the ladder, fits it,
trains the check runs and writes ``report.md``, ``report.png`` and ``isoflop.png``.
"""

import sys

from attnlab.experiment import base_config
from attnlab.experiment.harness import eval_at_end, tiny_twin
from attnlab.experiment.presets import MUP_DECODER, SHAKESPEARE_CHARS

LADDER = {
    "budgets": (1e9, 3e9, 9e9),
    "target": 2.7e10,
    "sizes": tuple({"model.d_model": d} for d in (8, 12, 16, 24, 32, 48, 64)),
    "variants": {
        "lr_1e-2": {"optim.learning_rate": 1e-2},
        "lr_2.5e-3": {"optim.learning_rate": 2.5e-3},
    },  # fmt: skip
    "min_steps": 40,
    "max_steps": 1000,
}
VARIANTS = ("tiny",)


def get_config(variant=None):
    c = base_config()
    c.name = "scaling_ladder"
    c.model.update(MUP_DECODER, n_heads=2)
    c.data.update(SHAKESPEARE_CHARS, seq_len=32)
    c.optim.update(learning_rate=1e-2, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1,
                   b2=0.99, weight_decay=0.0)  # fmt: skip
    eval_at_end(c, steps=100, batch_size=8, log_every_steps=100, eval_batches=16,
                eval_batch_size=16, seed=0)  # fmt: skip
    if variant == "tiny":
        tiny_twin(c, d_model=16, base_width=16, max_len=16, seq_len=16, max_chars=20_000)
    return c


def sweep(variant=None):
    """The ladder's trials (sizes x budgets x variants)."""
    from attnlab.sweep.ladder import ladder_trials

    trials, _ = ladder_trials(__file__, LADDER, variant)
    return trials


if __name__ == "__main__":
    from attnlab.sweep.ladder import main

    sys.exit(main(__file__, LADDER, sys.argv[1:]))
