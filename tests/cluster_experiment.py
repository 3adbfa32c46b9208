"""The cluster tier's experiment (tests/test_cluster.py): the tiny character model, a grid
of four trials, and an Optuna search that stacks its trials two at a time.

Variants: None (6 steps), ``long`` (120 steps: long enough to preempt or kill a process
mid-run), ``search`` (``long`` searched by Optuna with heartbeats every second)."""

import pathlib

from attnlab import experiment
from attnlab.sweep import grid, log_uniform, optuna_search

VARIANTS = ("long", "search")
CHAR_LM = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "char_lm.py"


def get_config(variant=None):
    c = experiment.import_experiment(CHAR_LM).get_config("tiny")
    c.train.update(steps=6, log_every_steps=1)
    c.eval.update(every_steps=3, batches=1, sample_tokens=0)
    c.checkpoint.update(every_steps=3)
    c.track.tensorboard = False
    c.data.pipeline = "index"  # the same global batches for any number of processes
    if variant in ("long", "search"):  # batches of 8 split over 8 devices
        c.train.update(steps=120, batch_size=8, log_every_steps=5)
        c.optim.learning_rate = 1e-3
        c.eval.every_steps = 120
        c.checkpoint.update(every_steps=20 if variant == "search" else 1000)
    return c


def sweep(variant=None):
    if variant == "search":
        return optuna_search(
            {"optim.learning_rate": log_uniform(1e-4, 1e-2)},
            num_trials=4,
            sampler="random",
            pruner="none",
            stack=2,
            heartbeat_interval=1,
            grace_period=3,
        )
    return grid({"optim.learning_rate": [1e-3, 2e-3, 3e-3, 4e-3]})
