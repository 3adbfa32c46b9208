"""Reopening a finished or interrupted run: its config, model and latest parameters.

A run trained with an attention variant registered by its experiment file reopens in any
process: loading ``DIR/config.json`` imports the experiment file it records first.
"""

from __future__ import annotations

import pathlib

from attnlab import experiment, sharding
from attnlab.checkpoint import Checkpointer
from attnlab.data import make_task
from attnlab.runs.workdir import CONFIG_FILE
from attnlab.train import Trainer


def saved_config(workdir):
    """The saved config of the run in ``workdir``, its experiment's variants registered."""
    workdir = pathlib.Path(workdir)
    path = workdir / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {workdir} an attnlab work directory?")
    cfg = experiment.from_json(path.read_text())
    experiment.register_variants(cfg)
    return cfg


def load_run(workdir):
    """(cfg, trainer, task, params, step) of the latest checkpoint in ``workdir``."""
    workdir = pathlib.Path(workdir)
    cfg = saved_config(workdir)
    task = make_task(cfg.data, workdir)
    trainer = Trainer(cfg, kind=task.kind, mesh=sharding.mesh_from_config(cfg))
    with Checkpointer(workdir / "checkpoints") as ckpt:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir / 'checkpoints'}")
        state = ckpt.restore(trainer.abstract_state(), step)
    return cfg, trainer, task, state["params"], step


def evaluate(workdir) -> dict:
    """Evaluates the latest checkpoint of a run on its validation split."""
    cfg, trainer, task, params, step = load_run(workdir)
    batches = task.eval_batches(int(cfg.eval.batch_size), max(int(cfg.eval.batches), 1))
    return {"step": step, **trainer.evaluate(params, batches)}
