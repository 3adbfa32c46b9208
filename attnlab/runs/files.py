"""A run directory's file names, and reading its checkpoints: what both a training run
(``attnlab.runs.workdir``) and a run loaded back (``attnlab.runs.loading``, and through it a
surgery run's source) need, so neither imports the other for them.

A LoRA run (``lora.rank`` above 0, ``attnlab.train.lora``) never changes its parameters: its
checkpoints hold the rest of the state (the adapters, their optimiser state, the step, the
accumulators, the key), ``DIR/lora_base/`` the frozen parameters, written once with the
first checkpoint, and ``DIR/lora_adapters.npz`` the newest checkpoint's adapters alone
(``lora.load`` reads it). Restoring puts the parameters back in the state, so a resumed run
never reads the model it started from again.
"""

from __future__ import annotations

import pathlib
import sys

import jax

from attnlab.errors import CheckpointError, WorkdirError
from attnlab.runs.checkpoint import Checkpointer, CorruptCheckpointError
from attnlab.train import lora
from attnlab.train.state import reconcile_acc

METRICS_FILE, SAMPLES_FILE, CONFIG_FILE = "metrics.jsonl", "samples.jsonl", "config.json"
LOCK_FILE, CHECKPOINTS = "lock", "checkpoints"
LORA_BASE, LORA_ADAPTERS = "lora_base", lora.FILE  # a LoRA run's (the module docstring)


def is_writer() -> bool:
    """Only process 0 writes a run's logs, metrics, samples and config (every process
    writes its own checkpoint shards)."""
    return jax.process_index() == 0


def check_workdir(workdir: pathlib.Path):
    """Refuses a path that cannot become a work directory, before anything is written."""
    for where in (workdir / CHECKPOINTS, workdir, *workdir.parents):
        if where.exists() and not where.is_dir():
            raise WorkdirError(
                f"{where} is a file, not a directory; move it away or choose another --workdir"
            )


def restore_newest(
    ckpt: Checkpointer, abstract, steps, all_finite, *, move_aside=False, empty_acc=None
):
    """``(state, step)`` of the newest of ``steps`` that restores with finite parameters.

    Unreadable checkpoints are skipped and reported in one line on stderr that names the
    step restored instead; with ``move_aside`` (a training run, which holds the directory's
    lock and would later write those steps again) they are moved to ``step_N.corrupt/``,
    otherwise they stay where they are. When ``steps`` is one step, its error is raised.

    With ``empty_acc`` (this run's empty accumulators), a train state's ``acc`` is read as
    the checkpoint holds it and fitted to ``empty_acc`` (``train.state.reconcile_acc``): a
    run whose set of metrics changed since the checkpoint resumes, new metrics from empty.
    """
    errors, reasons = [], []
    for step in sorted(steps, reverse=True):
        try:
            state = _restore_fitting_acc(ckpt, saved_part(abstract), step, empty_acc)
        except CorruptCheckpointError as e:
            if len(steps) == 1:
                raise
            errors.append(step)
            reasons.append(e.reason)
            continue
        if not bool(all_finite(lora.trained(state))):
            older = [s for s in ckpt.all_steps() if s < step]
            raise CheckpointError(
                f"checkpoint step {step} in {ckpt.directory} holds non-finite parameters (the "
                f"run diverged); pick an older step with --step N (available: {older})"
            )
        if errors:
            _report_unreadable(ckpt, errors, reasons, step, move_aside)
        if "lora" in abstract:
            state["params"] = restore_base(ckpt.directory.parent, abstract["params"])
        return state, step
    raise CheckpointError(
        f"no checkpoint in {ckpt.directory} can be restored (steps {errors} are unreadable: "
        f"{reasons[0] if reasons else ''}); train again in a new --workdir"
    )


def saved_part(state: dict) -> dict:
    """What a checkpoint holds of a train state: all of it, or a LoRA state's without its
    frozen parameters (``LORA_BASE`` holds them)."""
    return {k: v for k, v in state.items() if k != "params"} if "lora" in state else state


def save_base(workdir: pathlib.Path, params) -> None:
    """Writes a LoRA run's frozen parameters to ``DIR/lora_base/`` (replacing what is there)."""
    with Checkpointer(workdir / LORA_BASE, max_to_keep=1) as ckpt:
        for step in ckpt.all_steps():
            ckpt.delete(step)
        ckpt.save(0, params, force=True)


def restore_base(workdir: pathlib.Path, abstract_params):
    """A LoRA run's frozen parameters, from ``DIR/lora_base/``."""
    where = workdir / LORA_BASE
    if not where.is_dir():
        raise CheckpointError(
            f"{where} is missing: a LoRA run's checkpoints hold its adapters and that folder "
            "its frozen parameters; restore it from a backup, or train again in a new --workdir"
        )
    with Checkpointer(where) as ckpt:
        return ckpt.restore(abstract_params, 0)


def set_aside_unfinished(ckpt: Checkpointer, steps: list[int]) -> list[int]:
    """``steps`` without the newest ones whose save did not finish (the process died between
    orbax finalising a step and its checksums being written), which are moved to
    ``step_N.corrupt/`` in one warning line: a run resumes from the newest finished step, or
    starts afresh when there is none, as if those saves had never begun."""
    unfinished = []
    for step in sorted(steps, reverse=True):
        try:
            if not ckpt.unfinished(step):
                break
        except CorruptCheckpointError:  # unreadable metadata: restore_newest reports it
            break
        unfinished.append(step)
    left = [s for s in steps if s not in unfinished]
    if not unfinished or not is_writer():
        return left
    moved = [ckpt.move_aside(s).name for s in unfinished]
    then = f"resuming from step {max(left)}" if left else "starting from step 0"
    print(
        f"attnlab: warning: the save of checkpoint step {', '.join(map(str, unfinished))} in "
        f"{ckpt.directory} did not finish (its checksums were never written); moved to "
        f"{', '.join(moved)}; {then}",
        file=sys.stderr,
        flush=True,
    )
    return left


def set_aside_corrupt(ckpt: Checkpointer, step: int):
    """Moves the steps after ``step`` that fail ``Checkpointer.verify`` to ``step_N.corrupt/``
    (a run resumed from ``step`` would otherwise replace them), in one warning line."""
    errors, reasons = [], []
    for newer in (s for s in ckpt.all_steps() if s > step):
        try:
            ckpt.verify(newer)
        except CorruptCheckpointError as e:
            errors.append(newer)
            reasons.append(e.reason)
    if errors:
        _report_unreadable(ckpt, errors, reasons, step, move_aside=True, chosen=True)


def _restore_fitting_acc(ckpt: Checkpointer, abstract, step, empty_acc):
    """``ckpt.restore(abstract, step)``; with ``empty_acc``, ``abstract["acc"]`` is taken
    from the checkpoint's own tree and the result fitted to ``empty_acc``."""
    if empty_acc is None:
        return ckpt.restore(abstract, step)
    sharding = getattr(jax.tree.leaves(abstract["acc"])[0], "sharding", None)
    stored = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding),
        dict(ckpt.stored_tree(step)).get("acc", {}),
    )
    state = ckpt.restore({**abstract, "acc": stored}, step)
    return {**state, "acc": reconcile_acc(state["acc"], empty_acc)}


def _report_unreadable(ckpt, errors, reasons, step, move_aside, chosen=False):
    """One warning line: the unreadable steps, where they went, the step used instead."""
    kept = "left in place"
    if move_aside and is_writer():
        moved = [ckpt.move_aside(s).name for s in errors]
        kept = f"moved to {', '.join(moved)}"
    what = ", ".join(map(str, errors))
    used = f"resuming from --step {step}" if chosen else f"using checkpoint step {step} instead"
    print(
        f"attnlab: warning: checkpoint step {what} in {ckpt.directory} is unreadable or "
        f"corrupt ({reasons[0]}); {kept}; {used}",
        file=sys.stderr,
        flush=True,
    )
