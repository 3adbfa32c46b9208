"""Running a sweep: one ``train`` work directory per trial, resumable, failures recorded.

``DIR/sweep.json`` lists the trials and their overrides; ``DIR/<trial>/`` is an ordinary
``attnlab train`` work directory plus ``status.json``: ``{"status": "running" | "stopped" |
"finished" | "failed", "reason", "trial", "overrides", "mode", "step"}``. Re-running the
sweep skips finished trials (and failed ones unless ``retry_failed``) whose saved config still
matches, and resumes the others from their checkpoints. A trial that raises (a non-finite loss
is a ``FloatingPointError``) is marked failed with the reason and the sweep goes on.
"""

from __future__ import annotations

import json
import pathlib
import time
import traceback

from attnlab import experiment, runs
from attnlab.sweep.plan import Plan, group_trials
from attnlab.sweep.results import collect, write_results

STATUS_FILE, SWEEP_FILE = "status.json", "sweep.json"


def write_manifest(plan: Plan, workdir) -> pathlib.Path:
    """``DIR/sweep.json``: the experiment, shared overrides and each trial's overrides."""
    root = pathlib.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "config": plan.config,
        "overrides": list(plan.base_overrides),
        "trials": [{"name": t.name, "overrides": t.overrides} for t in plan.trials],
    }
    path = root / SWEEP_FILE
    runs.atomic_write(path, json.dumps(manifest, indent=2) + "\n")
    return path


def read_status(trial_dir) -> dict | None:
    path = pathlib.Path(trial_dir) / STATUS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _write_status(trial, trial_dir, mode, status, reason=None, step=None):
    record = {
        "trial": trial.name,
        "overrides": trial.overrides,
        "mode": mode,
        "status": status,
        "reason": reason,
        "step": step,
    }
    trial_dir.mkdir(parents=True, exist_ok=True)
    runs.atomic_write(trial_dir / STATUS_FILE, json.dumps(record, indent=2) + "\n")


def trial_settled(trial, trial_dir, retry_failed) -> str | None:
    """ "finished"/"failed" when the trial needs no more work, else None."""
    status = read_status(trial_dir)
    saved = trial_dir / runs.CONFIG_FILE
    if status is None or not saved.exists():
        return None
    if saved.read_text() != experiment.to_json(trial.cfg):
        return None  # the sweep changed (e.g. more steps): train resumes it
    if status["status"] == "finished" or (status["status"] == "failed" and not retry_failed):
        return status["status"]
    return None


def run_sweep(
    plan: Plan,
    workdir,
    *,
    parallel: str = "vmap",
    progress: bool = False,
    stop_after: int | None = None,
    retry_failed: bool = False,
    log=print,
) -> dict:
    """Trains every trial of ``plan`` under ``workdir`` and writes the results; returns them.

    ``parallel="vmap"`` trains each group of stackable trials as one vmapped program;
    ``"sequential"`` trains the trials one after another. ``stop_after`` stops each trial
    (or group) after that many steps with a checkpoint, as a preemption would.
    """
    root = pathlib.Path(workdir)
    write_manifest(plan, root)
    groups = group_trials(plan.trials, parallel)
    log(f"sweep: {len(plan.trials)} trial(s) in {len(groups)} group(s) under {root}")
    for i, group in enumerate(groups, 1):
        log(f"  group {i}: {group.describe()}")
    for i, group in enumerate(groups, 1):
        todo = []
        for t in group.trials:
            settled = trial_settled(t, root / t.name, retry_failed)
            if settled:
                log(f"skip {t.name} ({settled})")
            else:
                todo.append(t)
        if not todo:
            continue
        mode = group.mode if len(todo) > 1 else "sequential"
        log(f"group {i}: training {len(todo)} trial(s) ({mode})")
        preempted = (_run_stacked if mode == "vmap" else run_one_by_one)(
            todo, root, progress=progress, stop_after=stop_after, log=log
        )
        if preempted:
            log("sweep: stopped by a signal; run the same command again to resume")
            break
    results = collect(root)
    write_results(root, results)
    return results


def _run_stacked(trials, root, *, progress, stop_after, log) -> bool:
    dirs = [root / t.name for t in trials]
    for t, d in zip(trials, dirs, strict=True):
        _write_status(t, d, "vmap", "running")
    try:
        outcomes = runs.train_stacked(
            [t.cfg for t in trials], dirs, progress=progress, stop_after=stop_after
        )
    except Exception as e:
        reason = _reason(e)
        log(f"vmapped group failed: {reason}")
        for t, d in zip(trials, dirs, strict=True):
            _write_status(t, d, "vmap", "failed", reason)
        return False
    for t, d, out in zip(trials, dirs, outcomes, strict=True):
        _write_status(t, d, "vmap", out["status"], out["reason"], out["step"])
        log(_summary(t, out["status"], out["reason"], out["record"]))
    return any(out["preempted"] for out in outcomes)


def run_one_by_one(trials, root, *, progress, stop_after, log) -> bool:
    for t in trials:
        d = root / t.name
        _write_status(t, d, "sequential", "running")
        start = time.perf_counter()
        try:
            record = runs.train(t.cfg, d, progress=progress, stop_after=stop_after)
        except Exception as e:
            _write_status(t, d, "sequential", "failed", _reason(e))
            log(_summary(t, "failed", _reason(e), None))
            continue
        step = int(record.get("step", 0))
        status = "finished" if step >= int(t.cfg.train.steps) else "stopped"
        _write_status(t, d, "sequential", status, None, step)
        log(_summary(t, status, None, record) + f" in {time.perf_counter() - start:.1f}s")
        if status == "stopped" and stop_after is None:
            return True  # a signal stopped train(); leave the rest for the next run
    return False


def _reason(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" (at {pathlib.Path(where.filename).name}:{where.lineno})" if where else ""
    return f"{type(e).__name__}: {e}{at}"


def _summary(trial, status, reason, record) -> str:
    if status == "failed":
        return f"{trial.name}: failed: {reason}"
    loss = (record or {}).get("eval_loss", (record or {}).get("train_loss"))
    return f"{trial.name}: {status}" + (f", loss {loss:.4f}" if loss is not None else "")
