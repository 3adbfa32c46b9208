"""Running a sweep: one ``train`` work directory per trial, resumable, extensible.

``DIR/sweep.json`` lists the trials and their overrides; ``DIR/<trial>/`` is an ordinary
``attnlab train`` work directory plus ``status.json``: ``{"status": "running" | "stopped" |
"finished" | "failed" | "pruned", "reason", "trial", "overrides", "mode", "step"}``.

Before anything trains, ``plan_actions`` decides each trial's fate from its files: new
trials train, interrupted ones resume from their checkpoints, settled ones (finished, pruned,
failed unless ``retry_failed``) are skipped, and a finished trial whose config now asks for
more ``train.steps`` continues from its checkpoint when its learning-rate schedule does not
depend on the total (``EXTENSIBLE_SCHEDULES``: constant, or WSD, whose decay the new total
places and which continues from the newest checkpoint before the old decay began). Anything
else (a cosine schedule, other changed values) is refused in one line before any trial runs,
unless ``allow_changes``. A trial that raises is marked failed with the reason and the sweep
goes on; the sweep ends with one line counting what happened, and ``TrialsFailed`` when a
trial failed.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
import traceback

from attnlab import experiment, runs
from attnlab.errors import AttnlabError
from attnlab.runs.workdir import config_changes
from attnlab.sweep.plan import Plan, group_trials
from attnlab.sweep.results import collect_and_write
from attnlab.train.optim import EXTENSIBLE_SCHEDULES, wsd_decay_start

STATUS_FILE, SWEEP_FILE = "status.json", "sweep.json"
SETTLED = ("finished", "failed", "pruned")
OUTCOMES = ("finished", "failed", "skipped", "pruned", "stopped")


class TrialsFailed(AttnlabError, RuntimeError):
    """Trials of a sweep failed (the sweep itself ran): the command exits with 1."""

    exit_code = 1


@dataclasses.dataclass(frozen=True)
class Action:
    """What a sweep does with one trial: ``train`` (new or resumed), ``extend`` (a settled
    trial trained on to more steps, from checkpoint ``step`` or the newest) or ``skip``."""

    kind: str
    why: str = ""
    step: int | None = None
    allow_changes: bool = False


def write_manifest(plan: Plan, workdir) -> pathlib.Path:
    """``DIR/sweep.json``: the experiment, shared overrides and each trial's overrides.

    Trials listed by an earlier manifest stay listed (first), so adding seeds or grid points
    never hides the trials already trained."""
    root = pathlib.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / SWEEP_FILE
    trials = {t.name: t.overrides for t in plan.trials}
    if path.exists():
        old = json.loads(path.read_text())
        earlier = {t["name"]: t["overrides"] for t in old.get("trials", [])}
        trials = {**{k: v for k, v in earlier.items() if (root / k).is_dir()}, **trials}
    manifest = {
        "config": plan.config,
        "overrides": list(plan.base_overrides),
        "trials": [{"name": k, "overrides": v} for k, v in trials.items()],
    }
    runs.atomic_write(path, json.dumps(manifest, indent=2) + "\n")
    return path


def read_status(trial_dir) -> dict | None:
    path = pathlib.Path(trial_dir) / STATUS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def write_status(trial, trial_dir, mode, status, reason=None, step=None, **extra):
    record = {
        "trial": trial.name,
        "overrides": trial.overrides,
        "mode": mode,
        "status": status,
        "reason": reason,
        "step": step,
        **extra,
    }
    trial_dir.mkdir(parents=True, exist_ok=True)
    runs.atomic_write(trial_dir / STATUS_FILE, json.dumps(record, indent=2) + "\n")


def trial_settled(trial, trial_dir, retry_failed) -> str | None:
    """ "finished"/"failed"/"pruned" when the trial needs no more work, else None."""
    action = trial_action(trial, trial_dir, retry_failed=retry_failed, allow_changes=True)
    return action.why if action.kind == "skip" else None


def trial_action(trial, trial_dir, *, retry_failed=False, allow_changes=False) -> Action:
    """What to do with ``trial`` given ``trial_dir``; refusals raise ``ExperimentError``."""
    trial_dir = pathlib.Path(trial_dir)
    if not (trial_dir / runs.CONFIG_FILE).exists():
        return Action("train", "new")
    status = (read_status(trial_dir) or {}).get("status")
    changes = config_changes(trial_dir, trial.cfg)
    if not changes:
        if status in ("finished", "pruned") or (status == "failed" and not retry_failed):
            return Action("skip", status)
        return Action("train", "resume")
    keys = {c.split(":")[0]: c for c in changes}
    fixed = [k for k in keys if k.startswith(("model.", "data."))]
    if fixed:
        raise experiment.ExperimentError(
            f"trial {trial.name}: the sweep changes {', '.join(fixed)} of a trained trial; "
            "use a new --workdir"
        )
    saved = experiment.from_json((trial_dir / runs.CONFIG_FILE).read_text())
    old, new = int(saved.train.steps), int(trial.cfg.train.steps)
    others = [keys[k] for k in keys if k != "train.steps"]
    if others and not allow_changes:
        raise experiment.ExperimentError(
            f"trial {trial.name}: the sweep changes {'; '.join(others)}; pass --allow-changes "
            "to continue the trained trials with them, or use a new --workdir"
        )
    if status == "failed" and not retry_failed:
        return Action("skip", "failed")
    if status == "pruned":
        return Action("skip", "pruned")
    if new < old:
        raise experiment.ExperimentError(
            f"trial {trial.name}: train.steps={new} is fewer than the {old} it was trained "
            "for; use a new --workdir"
        )
    schedule = str(saved.optim.schedule)
    if new > old and schedule not in EXTENSIBLE_SCHEDULES and not allow_changes:
        raise experiment.ExperimentError(
            f"optim.schedule={schedule!r} depends on train.steps, so trials trained to {old} "
            f"steps cannot continue to {new} as if trained for {new}: pass --allow-changes "
            "to continue anyway (the schedule stretched from the resumed step), or sweep "
            "with --config.optim.schedule=wsd (or constant) in a new --workdir"
        )
    step = None
    if new > old and schedule == "wsd":  # continue from before the old decay began
        decay_start = wsd_decay_start(saved.optim, old)
        kept = [s for s in checkpoint_steps(trial_dir) if s <= decay_start]
        step = max(kept) if kept else None
    return Action("extend", f"{old} -> {new} steps", step, allow_changes=True)


def checkpoint_steps(trial_dir) -> list[int]:
    ckpts = pathlib.Path(trial_dir) / "checkpoints"
    return (
        sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
    )


def plan_actions(plan: Plan, root, *, retry_failed=False, allow_changes=False) -> dict:
    """Each trial's ``Action``; every refusal is raised before anything trains."""
    root = pathlib.Path(root)
    return {
        t.name: trial_action(
            t, root / t.name, retry_failed=retry_failed, allow_changes=allow_changes
        )
        for t in plan.trials
    }


def run_sweep(
    plan: Plan,
    workdir,
    *,
    parallel: str = "vmap",
    progress: bool = False,
    stop_after: int | None = None,
    retry_failed: bool = False,
    allow_changes: bool = False,
    log=print,
) -> dict:
    """Trains every trial of ``plan`` under ``workdir`` and writes the results; returns them
    (``results["outcomes"]`` counts this invocation's finished/failed/skipped/pruned trials).

    ``parallel="vmap"`` trains each group of stackable trials as one vmapped program;
    ``"sequential"`` trains the trials one after another. ``stop_after`` stops each trial
    (or group) after that many steps with a checkpoint, as a preemption would.
    """
    root = pathlib.Path(workdir)
    actions = plan_actions(plan, root, retry_failed=retry_failed, allow_changes=allow_changes)
    write_manifest(plan, root)
    groups = group_trials(plan.trials, parallel)
    log(f"sweep: {len(plan.trials)} trial(s) in {len(groups)} group(s) under {root}")
    for i, group in enumerate(groups, 1):
        log(f"  group {i}: {group.describe()}")
    tally = dict.fromkeys(OUTCOMES, 0)
    for i, group in enumerate(groups, 1):
        todo = []
        for t in group.trials:
            action = actions[t.name]
            if action.kind == "skip":
                log(f"skip {t.name} ({action.why})")
                tally["skipped"] += 1
            else:
                if action.kind == "extend":
                    log(f"extend {t.name} ({action.why})")
                todo.append(t)
        if not todo:
            continue
        mode = group.mode if len(todo) > 1 else "sequential"
        log(f"group {i}: training {len(todo)} trial(s) ({mode})")
        train = run_stacked if mode == "vmap" else run_one_by_one
        preempted = train(
            todo,
            root,
            progress=progress,
            stop_after=stop_after,
            log=log,
            actions=actions,
            tally=tally,
        )
        if preempted:
            log("sweep: stopped by a signal; run the same command again to resume")
            break
    results = collect_and_write(root)
    results["outcomes"] = tally
    log(summary_line(tally))
    return results


def summary_line(tally: dict) -> str:
    """``sweep: 4 finished, 1 failed, 2 skipped, 0 pruned`` (and stopped ones, if any)."""
    parts = [f"{tally.get(k, 0)} {k}" for k in ("finished", "failed", "skipped", "pruned")]
    if tally.get("stopped"):
        parts.append(f"{tally['stopped']} stopped")
    return "sweep: " + ", ".join(parts)


def check_failed(results: dict):
    """Raises ``TrialsFailed`` when the sweep's results hold a failed trial."""
    failed = [r["trial"] for r in results["trials"] if r["status"] == "failed"]
    if failed:
        shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        raise TrialsFailed(
            f"{len(failed)} trial(s) failed ({shown}); their reasons are in results.csv, "
            "--retry-failed trains them again"
        )


def _count(tally, status):
    if tally is not None:
        tally[status if status in tally else "stopped"] += 1


def run_stacked(
    trials, root, *, progress, stop_after, log, actions=None, tally=None, on_eval=None
) -> bool:
    """Trains ``trials`` as one stacked group; True when a signal stopped it."""
    dirs = [root / t.name for t in trials]
    chosen = [(actions or {}).get(t.name, Action("train")) for t in trials]
    for t, d in zip(trials, dirs, strict=True):
        write_status(t, d, "vmap", "running")
    try:
        outcomes = runs.train_stacked(
            [t.cfg for t in trials],
            dirs,
            progress=progress,
            stop_after=stop_after,
            on_eval=on_eval,
            steps=[a.step for a in chosen],
            allow_changes=any(a.allow_changes for a in chosen),
        )
    except Exception as e:
        reason = _reason(e)
        log(f"vmapped group failed: {reason}")
        for t, d in zip(trials, dirs, strict=True):
            write_status(t, d, "vmap", "failed", reason)
            _count(tally, "failed")
        return False
    for t, d, out in zip(trials, dirs, outcomes, strict=True):
        write_status(t, d, "vmap", out["status"], out["reason"], out["step"])
        _count(tally, out["status"])
        log(_summary(t, out["status"], out["reason"], out["record"]))
    return any(out["preempted"] for out in outcomes)


def run_one_by_one(
    trials, root, *, progress, stop_after, log, actions=None, tally=None, on_eval=None
) -> bool:
    """Trains ``trials`` one after another; True when a signal stopped one."""
    for t in trials:
        d = root / t.name
        action = (actions or {}).get(t.name, Action("train"))
        write_status(t, d, "sequential", "running")
        start = time.perf_counter()
        try:
            record = runs.train(
                t.cfg,
                d,
                progress=progress,
                stop_after=stop_after,
                step=action.step,
                allow_changes=action.allow_changes,
                on_eval=on_eval,
            )
        except Exception as e:
            write_status(t, d, "sequential", "failed", _reason(e))
            _count(tally, "failed")
            log(_summary(t, "failed", _reason(e), None))
            continue
        step = int(record.get("step", 0))
        status = "finished" if step >= int(t.cfg.train.steps) else "stopped"
        status = "pruned" if record.get("pruned") else status
        reason = f"pruned at step {step}" if status == "pruned" else None
        write_status(t, d, "sequential", status, reason, step)
        _count(tally, status)
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
