"""Reopening a finished or interrupted run: its config, model and latest parameters.

A run trained with an attention variant registered by its experiment file reopens in any
process: loading ``DIR/config.json`` imports the experiment file it records first.
"""

from __future__ import annotations

import math
import pathlib

from attnlab import experiment, sharding
from attnlab.checkpoint import Checkpointer
from attnlab.data import make_task
from attnlab.errors import CheckpointError, WorkdirError
from attnlab.runs.workdir import CHECKPOINTS, CONFIG_FILE, check_workdir, restore_newest
from attnlab.train import Trainer


def saved_config(workdir):
    """The saved config of the run in ``workdir``, its experiment's variants registered."""
    workdir = pathlib.Path(workdir)
    path = workdir / CONFIG_FILE
    check_workdir(workdir)
    if not path.is_file():
        raise WorkdirError(
            f"--workdir {workdir}: no {CONFIG_FILE}; is it an attnlab work directory (one that "
            "`attnlab train` wrote)?"
        )
    try:
        cfg = experiment.from_json(path.read_text())
    except (OSError, ValueError) as e:
        raise WorkdirError(f"{path} cannot be read ({e}); restore it from a backup") from None
    experiment.register_variants(cfg)
    return cfg


def load_run(workdir, step: int | None = None):
    """(cfg, trainer, task, params, step) of checkpoint ``step`` in ``workdir``.

    The default is the newest checkpoint that can be read (unreadable newer ones are reported
    on stderr); parameters that are not finite are refused with a ``CheckpointError``.
    """
    workdir = pathlib.Path(workdir)
    cfg = saved_config(workdir)
    task = make_task(cfg.data, workdir)
    trainer = Trainer(cfg, kind=task.kind, mesh=sharding.mesh_from_config(cfg))
    if not (workdir / CHECKPOINTS).is_dir():
        raise CheckpointError(f"no checkpoint in {workdir / CHECKPOINTS}; train the run first")
    with Checkpointer(workdir / CHECKPOINTS) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {ckpt.directory}; train the run first")
        if step is not None and int(step) not in steps:
            raise CheckpointError(
                f"--step {step}: no such checkpoint in {ckpt.directory} (available: {steps})"
            )
        chosen = steps if step is None else [int(step)]
        state, step = restore_newest(ckpt, trainer.abstract_state(), chosen, trainer.all_finite)
    return cfg, trainer, task, state["params"], step


def evaluate(workdir, step: int | None = None, *, full: bool = False) -> dict:
    """Evaluates checkpoint ``step`` (default: the newest readable one) on the validation
    split: the run's ``eval.batches`` batches, or with ``full`` every token of the split
    once (``Task.full_eval_batches``; the record then counts the ``eval_tokens``). A
    non-finite result is a ``CheckpointError``."""
    cfg, trainer, task, params, step = load_run(workdir, step)
    batch_size = int(cfg.eval.batch_size)
    if full:
        batches = list(task.full_eval_batches(batch_size))
    else:
        batches = task.eval_batches(batch_size, max(int(cfg.eval.batches), 1))
    record = trainer.evaluate(params, batches)
    if not math.isfinite(record["eval_loss"]):
        raise CheckpointError(
            f"checkpoint step {step} in {pathlib.Path(workdir) / CHECKPOINTS} gives a non-finite "
            "eval_loss; pick an older step with --step N"
        )
    if full:
        record["eval_tokens"] = int(sum(b["loss_mask"].sum() for b in batches))
    return {"step": step, **record}
