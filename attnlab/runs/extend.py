"""A resumed run with another ``train.steps``: what its learning-rate schedule does.

The schedule is a function of the step and of ``train.steps`` (a cosine decays over the steps
after warmup). A run resumed with a changed ``train.steps`` (``--allow-changes``) rebuilds it
for the new total, so the rate jumps at the resumed step; ``attnlab train --extend`` instead
records ``[resumed step, train.steps before]`` in ``optim.extended`` and the schedule carries
on from the rate it had, its remaining shape stretched to the new total
(``attnlab.train.optim.lr_multiplier``). Either way the run says in one line what the
schedule does (``schedule_note``). A resumed run keeps the extensions its saved config
records when the config it is given has none.
"""

from __future__ import annotations

import json
import pathlib

from attnlab import experiment
from attnlab.runs.files import CHECKPOINTS, CONFIG_FILE
from attnlab.train.optim import lr_multiplier

# What --extend changes in a saved config: its own consent covers these two.
EXTEND_KEYS = ("train.steps", "optim.extended")


def saved(workdir):
    """The config saved in ``workdir`` (None: none, or unreadable)."""
    workdir = pathlib.Path(workdir)
    path = workdir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return experiment.from_json(path.read_text())
    except (OSError, ValueError):
        return None  # check_config reports it in its own line


def _pairs(o) -> list[list[int]]:
    return [[int(a), int(b)] for a, b in (o.get("extended") or ())]


def _set_pairs(cfg, pairs):
    cfg = experiment.from_json(experiment.to_json(cfg))  # a copy
    with cfg.unlocked():
        cfg.optim.extended = tuple(tuple(p) for p in pairs)
    return cfg


def resume_step(workdir: pathlib.Path, step=None) -> int | None:
    """The checkpoint a resumed run starts from: ``step``, else the newest finished one."""
    if step is not None:
        return int(step)
    folder = workdir / CHECKPOINTS
    if not folder.is_dir():
        return None
    done = [
        int(p.name)
        for p in folder.iterdir()
        if p.name.isdigit() and (p / "commit_success.txt").exists()
    ]
    return max(done, default=None)


def resolve(cfg, workdir, *, step=None, extend: bool = False):
    """``(cfg, consent)``: the config a run in ``workdir`` trains with, and whether
    ``--extend`` consents to its changes (``train.steps`` and ``optim.extended`` only).

    A resumed run keeps the saved ``optim.extended`` unless ``cfg`` sets its own; with
    ``extend`` a changed ``train.steps`` adds ``[resumed step, saved train.steps]`` to it."""
    workdir = pathlib.Path(workdir)
    saved_cfg = saved(workdir)
    if saved_cfg is None or resume_step(workdir, step) is None:
        if extend:
            raise experiment.ExperimentError(
                f"--extend: {workdir} holds no checkpoint of a run to train on; drop --extend "
                "to start the run"
            )
        return cfg, False
    pairs = _pairs(cfg.optim) or _pairs(saved_cfg.optim)
    if not extend:
        return (_set_pairs(cfg, pairs) if pairs != _pairs(cfg.optim) else cfg), False
    before, after = int(saved_cfg.train.steps), int(cfg.train.steps)
    if after != before:
        pairs = _pairs(saved_cfg.optim) + [[resume_step(workdir, step), before]]
    cfg = _set_pairs(cfg, pairs)
    changed = experiment.flat_keys(json.loads(experiment.to_json(cfg)))
    kept = experiment.flat_keys(json.loads(experiment.to_json(saved_cfg)))
    others = [k for k in set(changed) | set(kept) if changed.get(k) != kept.get(k)]
    return cfg, all(k.startswith(EXTEND_KEYS) for k in others)


def _rate(o, total: int, step: int) -> float:
    return float(o.learning_rate) * float(lr_multiplier(o, total)(step))


def schedule_note(saved, cfg, start: int) -> str | None:
    """The line a run resumed at ``start`` prints when its ``train.steps`` differs from the
    ``saved`` config's; None when it does not."""
    if saved is None:
        return None
    before, after = int(saved.train.steps), int(cfg.train.steps)
    if before == after:
        return None
    was, now = _rate(saved.optim, before, start), _rate(cfg.optim, after, start)
    extended = _pairs(cfg.optim)
    if extended and extended[-1] == [start, before] and extended != _pairs(saved.optim):
        return (
            f"train.steps {before} -> {after} with --extend: the learning-rate schedule "
            f"carries on from step {start} at {was:.3g}, its remaining shape stretched to end "
            f"at step {after}"
        )
    if abs(was - now) <= 1e-6 * max(abs(was), 1e-30):
        return (
            f"train.steps {before} -> {after}: the learning-rate schedule is rebuilt for "
            f"{after} steps; at the resumed step {start} the learning rate stays at {was:.3g}"
        )
    return (
        f"train.steps {before} -> {after}: the learning-rate schedule is rebuilt for {after} "
        f"steps, so at the resumed step {start} the learning rate goes from {was:.3g} to "
        f"{now:.3g}; pass --extend instead to carry on with the original schedule's shape"
    )
