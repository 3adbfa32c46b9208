"""Everything a run will need later, checked before its work directory is touched.

``preflight`` opens one run (``open_runs`` calls it for each run once the config is
validated): its checks come before ``Run.begin`` writes anything, so a run that cannot
start fails in one line (an ``attnlab.errors`` exception) with its work directory as it
was. In order:

1. the optional packages the config selects (``PACKAGES``), found without importing them;
   a missing one is named with the extra that brings it;
2. the paths the run will write (``paths``): no file where a folder goes (or the reverse),
   and the work directory (or the nearest folder above it that exists) writable;
3. the saved config of a resumed run, the data and its tokenizer (``workdir.Run``);
4. the sample prompt against the tokenizer and the model's context
   (``sampling.sample_plan``, which the samples use later);
5. the model, the optimiser and the training batch against the mesh (``Trainer``);
6. the evaluation batches, built once here (the loop uses these) and placed on the mesh.

If the run still fails before its first step (a checkpoint that cannot be restored, a step
that does not compile, a signal), ``Run.close(discard=True)`` removes what its start
created: the work directory when the run made it, else the new files and folders in it.
"""

from __future__ import annotations

import os
import pathlib

from attnlab.data.tasks import TOKENIZER_FILE
from attnlab.devices import sharding
from attnlab.errors import ConfigError, WorkdirError, one_line, require
from attnlab.runs.files import (
    CHECKPOINTS,
    CONFIG_FILE,
    LOCK_FILE,
    LORA_ADAPTERS,
    LORA_BASE,
    METRICS_FILE,
    SAMPLES_FILE,
    check_workdir,
)
from attnlab.runs.sampling import sample_plan
from attnlab.runs.tracking import TB_DIR, WANDB_DIR
from attnlab.runs.workdir import Run
from attnlab.train import Trainer

# Data kinds whose batches come from Grain (attnlab.data.grain_pipeline).
GRAIN_KINDS = ("text", "mlm_text", "prepared")

# (whether the config selects it, the module, the pyproject extra, the value that asks).
PACKAGES = [
    (
        lambda c: c.data.get("kind") in GRAIN_KINDS or bool(c.data.get("source")),
        "grain",
        None,  # a core dependency
        lambda c: f"data.kind={c.data.get('kind')!r} (its batches come from Grain)",
    ),
    (
        lambda c: c.data.get("source") == "hf_datasets",
        "datasets",
        "datasets",
        lambda c: "data.source='hf_datasets'",
    ),
    (
        lambda c: bool((c.get("track") or {}).get("wandb_project")),
        "wandb",
        "cluster",
        lambda c: f"track.wandb_project={c.track.wandb_project!r}",
    ),
]


def packages(cfg) -> None:
    """Refuses a config that selects an optional package that is not installed."""
    for selects, module, extra, what in PACKAGES:
        if selects(cfg):
            require(module, extra, what(cfg))


def written_paths(cfg) -> tuple[list[str], list[str]]:
    """The folders and the files a run writes in its work directory."""
    track = cfg.get("track") or {}
    folders = [CHECKPOINTS]
    folders += [TB_DIR] if track.get("tensorboard", True) else []
    folders += [WANDB_DIR] if track.get("wandb_project") else []
    files = [CONFIG_FILE, TOKENIZER_FILE, METRICS_FILE, SAMPLES_FILE, LOCK_FILE]
    if (cfg.get("lora") or {}).get("rank"):
        folders, files = folders + [LORA_BASE], files + [LORA_ADAPTERS]
    return folders, files


def paths(cfg, workdir: pathlib.Path) -> None:
    """Refuses a work directory the run could not write: a file where it or one of its
    folders goes, a folder where one of its files goes, a folder that is not writable."""
    check_workdir(workdir)
    folders, files = written_paths(cfg)
    for name in folders:
        if (workdir / name).exists() and not (workdir / name).is_dir():
            raise WorkdirError(
                f"{workdir / name} is a file where the run writes a folder; move it away or "
                "choose another --workdir"
            )
    for name in files:
        if (workdir / name).is_dir():
            raise WorkdirError(
                f"{workdir / name} is a folder where the run writes a file; move it away or "
                "choose another --workdir"
            )
    nearest = next(p for p in (workdir, *workdir.parents) if p.exists())
    targets = [nearest] + [
        workdir / n for n in folders + files if nearest == workdir and (workdir / n).exists()
    ]
    for path in targets:
        if not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            what = "the folder above it, " if path != workdir and nearest == path else ""
            raise WorkdirError(
                f"cannot write to {path} ({what}not writable); make it writable or choose "
                "another --workdir"
            )


def eval_batches(cfg, task, trainer) -> list:
    """The run's evaluation batches (none when ``eval.batches`` is 0), each padded and
    placed on the mesh once here, as the evaluation will."""
    e = cfg.eval
    if not int(e.batches):
        return []
    batches = task.eval_batches(int(e.batch_size), int(e.batches))
    if trainer.mesh is not None:
        for b in batches[:1] + batches[-1:]:  # the first and a ragged last
            try:
                sharding.place_batch(trainer.pad_to_mesh(b), trainer.mesh, trainer.rules)
            except ValueError as err:
                raise ConfigError(
                    f"eval.batch_size={int(e.batch_size)}: the evaluation batches cannot be "
                    f"placed on the mesh ({one_line(err)}); change eval.batch_size or the mesh"
                ) from None
    return batches


def preflight(cfg, workdir, mcfg, mesh, *, step=None, allow_changes=False):
    """``(run, trainer)`` of one run, everything it needs checked (see the module
    docstring) and nothing written; ``run.eval_batches`` holds its evaluation batches."""
    workdir = pathlib.Path(workdir)
    packages(cfg)
    paths(cfg, workdir)
    run = Run(cfg, workdir, mcfg, step=step, allow_changes=allow_changes)
    sample_plan(run.task.kind, run.task, cfg, mcfg.max_len)
    trainer = Trainer(cfg, mcfg, kind=run.task.kind, mesh=mesh)
    run.eval_batches = eval_batches(cfg, run.task, trainer)
    return run, trainer
