"""Learning-rate transfer across width (muP) and depth (CompleteP) on tiny Shakespeare.

The same learning-rate sweep at several widths (or depths), three seeds each: under the
standard parametrisation the best learning rate moves as the model widens; under muP
(``model.parametrization="mup"``, relative to ``model.base_width``) it stays, and the wider
model is never worse. Across depth, CompleteP (``"completep"``, relative to
``model.base_depth``) does the same. Each width's learning rates and seeds differ only in
values the train state holds, so they train as one stacked program.

Variants (``--config experiments/mup_transfer.py:VARIANT``, and ``sweep(VARIANT)``):
``standard`` and ``mup`` (width), ``depth_standard`` and ``depth_completep`` (depth),
``opt_<name>`` (muP with the registered optimiser ``name``: lion, adafactor,
schedule_free_adamw, adabelief, muon, sgd), ``tiny`` (the CPU twin).

``python experiments/mup_transfer.py --workdir runs/mup_transfer`` runs every sweep, then
writes ``transfer.md`` (the table of best learning rates) and ``transfer.png`` into the
work directory; docs/guides/parametrization.md shows a run.
"""

import sys

from attnlab.experiment import base_config
from attnlab.experiment.harness import eval_at_end, tiny_twin
from attnlab.experiment.presets import MUP_DECODER, SHAKESPEARE_CHARS
from attnlab.sweep import grid

WIDTHS = (32, 64, 128)
DEPTHS = (1, 2, 4)
SEEDS = (0, 1, 2)
# Peak learning rates, a factor of 2 apart (one grid step).
LEARNING_RATES = (1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2, 8e-2)
# Per optimiser: its grid (Lion's steps are larger than Adam's; SGD's far smaller).
OPTIMIZER_RATES = {
    "lion": (1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2),
    "sgd": (0.1, 0.2, 0.4, 0.8, 1.6),
    "muon": (1e-2, 2e-2, 4e-2, 8e-2, 1.6e-1),
}
OPTIMIZERS = ("adafactor", "schedule_free_adamw", "adabelief", "lion", "muon", "sgd")
VARIANTS = ("tiny", "standard", "mup", "depth_standard", "depth_completep") + tuple(
    f"opt_{name}" for name in OPTIMIZERS
)


def get_config(variant=None):
    c = base_config()
    c.name = "mup_transfer"
    c.model.update(MUP_DECODER, d_model=WIDTHS[0], n_heads=4, base_width=WIDTHS[0], base_depth=2)
    c.data.update(SHAKESPEARE_CHARS, seq_len=32)
    c.optim.update(learning_rate=1e-2, adam_learning_rate=1e-2, warmup_steps=10,
                   schedule="cosine", min_lr_ratio=0.1, b2=0.99, weight_decay=0.0)  # fmt: skip
    eval_at_end(c, steps=120, batch_size=8, log_every_steps=40, eval_batches=8,
                eval_batch_size=16, seed=0)  # fmt: skip
    variant = variant or "mup"
    if variant in ("standard", "depth_standard"):
        c.model.parametrization = "standard"
    elif variant == "depth_completep":
        c.model.parametrization = "completep"
    elif variant.startswith("opt_"):
        c.optim.name = variant[len("opt_") :]
        c.optim.schedule = "constant" if c.optim.name == "schedule_free_adamw" else "cosine"
    if variant.startswith("depth_"):
        c.model.update(d_model=64, base_width=64, n_layers=DEPTHS[0], base_depth=DEPTHS[0])
    if variant == "tiny":
        tiny_twin(c, d_model=16, base_width=16, max_len=16, seq_len=16, max_chars=20_000)
    return c


def sweep(variant=None):
    """Learning rate x seed at every width (or depth) of the variant."""
    variant = variant or "mup"
    if variant == "tiny":
        return grid({"model.d_model": [16, 32], "optim.learning_rate": [1e-2, 2e-2],
                     "train.seed": [0]})  # fmt: skip
    if variant.startswith("depth_"):
        return grid({"model.n_layers": list(DEPTHS), "optim.learning_rate": list(LEARNING_RATES),
                     "train.seed": list(SEEDS)})  # fmt: skip
    if variant.startswith("opt_"):
        name = variant[len("opt_") :]
        rates = OPTIMIZER_RATES.get(name, LEARNING_RATES[1:-1])
        return grid({"model.d_model": [WIDTHS[0], WIDTHS[-1]], "optim.learning_rate": list(rates),
                     "train.seed": [0]})  # fmt: skip
    return grid({"model.d_model": list(WIDTHS), "optim.learning_rate": list(LEARNING_RATES),
                 "train.seed": list(SEEDS)})  # fmt: skip


if __name__ == "__main__":
    from attnlab.sweep.transfer import main

    sys.exit(main(__file__, sys.argv[1:]))
