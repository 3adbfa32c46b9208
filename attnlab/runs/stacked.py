"""Stacked trials: runs that differ only in ``STACKABLE`` values, trained as one program.

Each run is initialised by one shared program (its seed an argument, its optimiser values
set after), then every state leaf is stacked on a leading trial axis and one compiled step
trains them all: vmapped on an accelerator, one trial after another inside the program on
CPU (``Trainer.stack_by``); each run's files are written as if it had trained alone.
"""

from __future__ import annotations

import json

from attnlab import experiment
from attnlab.runs.loop import Pruned, train_runs

# Trials whose configs differ only in these values have the same array shapes and the same
# traced program (the optimiser hyperparameters live in the state, initialisation happens
# before stacking), so they can be stacked on a leading axis and trained by one step.
STACKABLE = (
    "train.seed",
    "optim.learning_rate",
    "optim.weight_decay",
    "optim.b1",
    "optim.b2",
    "optim.eps",
    "model.init_std",
)


def stack_key(cfg) -> str:
    """The config without its ``STACKABLE`` values: trials with equal keys can be stacked."""
    values = cfg.to_dict()
    for dotted in STACKABLE:
        group, leaf = dotted.split(".")
        values[group].pop(leaf, None)
    return json.dumps(values, sort_keys=True)


def train_stacked(
    cfgs,
    workdirs,
    *,
    progress: bool = True,
    stop_after: int | None = None,
    on_eval=None,
    steps=None,
    allow_changes: bool = False,
):
    """Trains (or resumes) several runs that differ only in ``STACKABLE`` values at once.

    Each run is initialised from its own config, then params, optimiser state (with its
    hyperparameters), step, accumulators and RNG key data are stacked on a leading axis and
    trained by one jitted step; every step stacks each run's own batch. Each
    ``workdirs[i]`` ends up as ``train(cfgs[i], workdirs[i])`` would leave it. A run whose
    loss turns non-finite is dropped from the logs and checkpoints; the others go on.
    ``on_eval(run, record) -> bool`` may stop a run after an evaluation (a search's pruner):
    its row is masked and the others go on. ``steps[i]`` picks the checkpoint run ``i``
    resumes from (None: the newest); ``allow_changes`` resumes with changed values.

    Returns one dict per run: ``status`` ("finished", "stopped", "pruned" or "failed"),
    ``reason``,
    ``step``, ``record`` (the final log record, if any) and ``preempted``.
    """
    cfgs = list(cfgs)
    keys = {stack_key(c) for c in cfgs}
    if len(keys) > 1:
        raise experiment.ExperimentError(
            f"train_stacked: the configs differ in more than {', '.join(STACKABLE)}; "
            "train them separately"
        )
    runs, preempted = train_runs(
        cfgs,
        workdirs,
        stacked=True,
        progress=progress,
        stop_after=stop_after,
        on_eval=on_eval,
        step=list(steps) if steps is not None else None,
        allow_changes=allow_changes,
    )
    out = []
    for r in runs:
        if isinstance(r.failure, Pruned):
            status, reason = "pruned", str(r.failure)
        elif r.failure is not None:
            status, reason = "failed", f"{type(r.failure).__name__}: {r.failure}"
        else:
            status = "finished" if r.step >= int(r.cfg.train.steps) else "stopped"
            reason = None
        out.append(
            {
                "workdir": str(r.workdir),
                "status": status,
                "reason": reason,
                "step": r.step,
                "record": r.record,
                "preempted": preempted,
            }
        )
    return out
