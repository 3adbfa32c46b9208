"""Searching with Optuna: a study that suggests trials, trains them stacked and prunes them.

An experiment's ``sweep(variant=None)`` returns ``optuna_search(...)`` (or a dict with
``"method": "optuna"`` and the same fields) instead of a list of trials::

    from attnlab.sweep import choice, log_uniform, optuna_search

    def sweep(variant=None):
        return optuna_search(
            {"optim.learning_rate": log_uniform(1e-4, 1e-2), "optim.b2": choice([0.95, 0.99])},
            num_trials=16, sampler="tpe", pruner="asha", stack=4,
        )

``run_search`` asks the study for ``stack`` trials at a time; those whose configs differ only
in ``attnlab.runs.STACKABLE`` values train as one stacked program, the others alone. Every
evaluation of a trial is reported to the study as an intermediate value (its step the
training step), and when the pruner says so the trial stops: checkpointed where it stands,
its row of a stacked group masked (its learning rate set to 0 in the optimiser state, the
compiled program unchanged) while the others train on. A finished trial's value is its last
``metric`` (``eval_loss`` by default).

The study lives in Optuna storage: ``sqlite:///DIR/study.db`` by default, or any database
URL (``storage=``, ``--storage``), so several ``attnlab sweep`` processes (SLURM jobs through
``--launcher slurm --workers N``) share one study. In a database server (PostgreSQL, MySQL)
each worker records a heartbeat for the trials it trains; a trial whose worker died (its
heartbeat older than ``grace_period`` seconds) is failed and asked again with the same values
and directory, so it resumes from its checkpoint and counts once towards ``num_trials``;
each worker ends once every trial is complete, pruned or failed. A killed search run again
resumes the same study: its unfinished trials continue from their checkpoints in
``DIR/trial-NNNN/`` and new ones are asked only until ``num_trials`` exist. Results:
``DIR/results.*`` as for any sweep, ``DIR/best.json`` (the best trial, its value, parameters
and config), and Optuna's ``param_importances.png`` and ``parallel_coordinate.png``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pathlib
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from attnlab import experiment, runs
from attnlab.experiment import ExperimentError
from attnlab.runs import surgery_run as surgery
from attnlab.sweep.plan import Trial, apply_overrides, group_trials, plan_sweep
from attnlab.sweep.results import collect_and_write
from attnlab.sweep.run import (
    OUTCOMES,
    checkpoint_steps,
    run_one_by_one,
    run_stacked,
    summary_line,
)
from attnlab.sweep.search_report import (
    final_value,
    write_best,
    write_manifest,
    write_plots,
)
from attnlab.sweep.spec import SCALARS, Choice, LogUniform, Uniform
from attnlab.sweep.study import (  # noqa: F401  (also read from here)
    STUDY_FILE,
    Heartbeat,
    _optuna,
    counted,
    default_storage,
    make_storage,
    redact,
    surplus,
    with_heartbeat,
)

SAMPLERS = ("tpe", "cmaes", "random", "grid")
PRUNERS = ("none", "median", "asha", "successive_halving", "hyperband")


@dataclasses.dataclass(frozen=True)
class Search:
    """An Optuna search: the space, how many trials, the sampler and the pruner."""

    space: dict[str, Any]
    num_trials: int
    sampler: str = "tpe"
    pruner: str = "median"
    seed: int = 0
    stack: int = 4  # trials asked at once, trained stacked where they can be
    metric: str = "eval_loss"
    direction: str = "minimize"
    sampler_options: dict = dataclasses.field(default_factory=dict)
    pruner_options: dict = dataclasses.field(default_factory=dict)
    method: str = "optuna"
    # A study in a database server: each worker marks its trials alive this often (seconds);
    # a trial silent for grace_period is failed and asked again (from its checkpoint).
    heartbeat_interval: int = 10
    grace_period: int = 30


@dataclasses.dataclass(frozen=True)
class SearchPlan:
    config: str  # the experiment, as given to --config
    base_overrides: tuple[str, ...]
    search: Search
    base: Any  # the experiment's config with the flags applied


def optuna_search(space: Mapping[str, Any], num_trials: int, **options) -> Search:
    """A checked ``Search`` (see the module docstring for the options)."""
    return as_search(
        {"method": "optuna", "space": dict(space), "num_trials": num_trials, **options}
    )


def is_search(spec) -> bool:
    return isinstance(spec, Search) or (isinstance(spec, Mapping) and "method" in spec)


def as_search(spec) -> Search:
    """A ``Search`` from itself or a ``{"method": "optuna", ...}`` dict; mistakes name the field."""
    if isinstance(spec, Mapping):
        fields = {f.name for f in dataclasses.fields(Search)}
        unknown = sorted(set(spec) - fields)
        if unknown:
            raise ExperimentError(f"sweep: unknown search field(s) {unknown}; use {sorted(fields)}")
        if spec.get("method") != "optuna":
            raise ExperimentError(f"sweep: method={spec.get('method')!r}: use 'optuna'")
        if "space" not in spec or "num_trials" not in spec:
            raise ExperimentError("sweep: an optuna search needs 'space' and 'num_trials'")
        spec = Search(**spec)
    s = spec
    n = s.num_trials
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ExperimentError(f"sweep: num_trials={n!r} must be a positive integer")
    if isinstance(s.stack, bool) or not isinstance(s.stack, int) or s.stack <= 0:
        raise ExperimentError(f"sweep: stack={s.stack!r} must be a positive integer")
    if s.sampler not in SAMPLERS:
        raise ExperimentError(f"sweep: sampler={s.sampler!r}: use one of {list(SAMPLERS)}")
    if s.pruner not in PRUNERS and not hasattr(s.pruner, "prune"):
        raise ExperimentError(f"sweep: pruner={s.pruner!r}: use one of {list(PRUNERS)}")
    for name in ("heartbeat_interval", "grace_period"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ExperimentError(f"sweep: {name}={v!r} must be a positive number of seconds")
    if s.direction not in ("minimize", "maximize"):
        raise ExperimentError(f"sweep: direction={s.direction!r}: use 'minimize' or 'maximize'")
    if not isinstance(s.space, Mapping) or not s.space:
        raise ExperimentError("sweep: the search space is a non-empty dict of config keys")
    for key, dist in s.space.items():
        if not isinstance(dist, (LogUniform, Uniform, Choice, *SCALARS)):
            raise ExperimentError(
                f"sweep: {key}={dist!r}: use log_uniform, uniform, choice or a fixed value"
            )
        if s.sampler == "grid" and isinstance(dist, LogUniform | Uniform):
            raise ExperimentError(f"sweep: sampler='grid' needs choice([...]) for {key}")
    return s


def plan_search(config: str, overrides, spec) -> SearchPlan:
    """Checks the search and every fixed value on the experiment before anything runs."""
    search = as_search(spec)
    base = experiment.load_config(config, list(overrides))
    probe = {k: _example(v) for k, v in search.space.items()}
    try:
        experiment.validate(surgery.resolve(apply_overrides(base, probe)))
    except ExperimentError as e:
        raise ExperimentError(f"sweep: the search space: {e}") from None
    return SearchPlan(config, tuple(overrides), search, base)


def _example(dist):
    if isinstance(dist, Choice):
        return dist.options[0]
    if isinstance(dist, LogUniform | Uniform):
        return dist.low
    return dist


# The study -----------------------------------------------------------------------------------
def make_sampler(search: Search, worker: int = 0):
    """The sampler; ``worker`` tells the workers of one study apart (the same seed in each
    would suggest the same values in each)."""
    optuna = _optuna()
    opts = dict(search.sampler_options)
    seed = (search.seed + 7919 * int(worker)) % 2**32
    if search.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, **opts)
    if search.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, **opts)
    if search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed, **opts)
    grid = {k: list(d.options) for k, d in search.space.items() if isinstance(d, Choice)}
    return optuna.samplers.GridSampler(grid, seed=seed, **opts)


def make_pruner(search: Search, total_steps: int):
    optuna = _optuna()
    if hasattr(search.pruner, "prune"):  # an Optuna pruner object
        return search.pruner
    opts = dict(search.pruner_options)
    if search.pruner == "none":
        return optuna.pruners.NopPruner()
    if search.pruner == "median":
        return optuna.pruners.MedianPruner(**opts)
    if search.pruner in ("asha", "successive_halving"):
        return optuna.pruners.SuccessiveHalvingPruner(**opts)
    opts.setdefault("max_resource", total_steps)
    return optuna.pruners.HyperbandPruner(**opts)


def open_study(plan: SearchPlan, root, storage=None, study_name=None):
    """The study of the search in ``root`` (created, or loaded to resume it)."""
    optuna = _optuna()
    search = plan.search
    url = storage or default_storage(root)
    # workers sharing a database server: each its own stream of suggestions
    worker = os.getpid() % 100_003 if with_heartbeat(url) else 0
    return optuna.create_study(
        storage=make_storage(url, search),
        study_name=study_name or pathlib.Path(root).resolve().name,
        sampler=make_sampler(search, worker),
        pruner=make_pruner(search, int(plan.base.train.steps)),
        direction=search.direction,
        load_if_exists=True,
    )


def _suggest(trial, search: Search) -> dict:
    values = {}
    for key, dist in search.space.items():
        if isinstance(dist, LogUniform):
            values[key] = trial.suggest_float(key, dist.low, dist.high, log=True)
        elif isinstance(dist, Uniform):
            values[key] = trial.suggest_float(key, dist.low, dist.high)
        elif isinstance(dist, Choice):
            values[key] = trial.suggest_categorical(key, list(dist.options))
        else:
            values[key] = dist
    return values


def trial_dir_name(number: int) -> str:
    return f"trial-{number:04d}"


def _orphaned(frozen, root) -> bool:
    """A RUNNING trial nobody trains any more (its process died), so this one may."""
    attrs = frozen.user_attrs
    if attrs.get("host") == socket.gethostname():
        try:
            os.kill(int(attrs.get("pid", 0)), 0)
            return int(attrs.get("pid", 0)) == os.getpid()
        except (OSError, ValueError):
            return True
    d = pathlib.Path(root) / attrs.get("dir", trial_dir_name(frozen.number))
    try:  # another host: its work directory's lock says whether it is trained now
        runs.workdir.Lock(d).release()
    except Exception:
        return False
    return True


def run_search(
    plan: SearchPlan,
    workdir,
    *,
    storage: str | None = None,
    study_name: str | None = None,
    parallel: str = "vmap",
    progress: bool = False,
    stop_after: int | None = None,
    log=print,
) -> dict:
    """Runs (or resumes) the search of ``plan`` in ``workdir``; returns the results, with
    ``results["best"]`` and ``results["outcomes"]``."""
    optuna = _optuna()
    root = pathlib.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    study = open_study(plan, root, storage, study_name)
    search = plan.search
    tally = dict.fromkeys(OUTCOMES, 0)
    running = optuna.trial.TrialState.RUNNING
    url = storage or default_storage(root)
    heartbeat = with_heartbeat(url)
    log(
        f"search: {search.num_trials} trial(s), sampler {search.sampler}, pruner "
        f"{search.pruner if isinstance(search.pruner, str) else type(search.pruner).__name__}, "
        f"{search.stack} at a time; study {study.study_name} in {redact(url)}"
    )
    while True:
        if heartbeat:  # the trials of dead workers fail, and come back as waiting trials
            optuna.storages.fail_stale_trials(study)
            batch = []
        else:  # one machine: a trial whose process is gone is resumed here
            batch = [
                optuna.trial.Trial(study, f._trial_id)
                for f in study.get_trials(deepcopy=False, states=(running,))
                if _orphaned(f, root)
            ][: search.stack]
        if batch:
            log(f"search: resuming trial(s) {', '.join(str(t.number) for t in batch)}")
        while len(batch) < search.stack and (
            counted(study) < search.num_trials
            or study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
        ):
            trial = study.ask()
            if heartbeat and surplus(study, trial, search.num_trials):
                break  # another worker asked the last trials at the same moment
            batch.append(trial)
        if not batch and heartbeat and study.get_trials(deepcopy=False, states=(running,)):
            time.sleep(search.heartbeat_interval)  # other workers' trials: done or failed soon
            continue
        if not batch:
            break
        trials, by_dir = [], {}
        for t in batch:
            if "dir" not in t.user_attrs:
                values = _suggest(t, search)
                t.set_user_attr("overrides", values)
                t.set_user_attr("dir", trial_dir_name(t.number))
            t.set_user_attr("host", socket.gethostname())
            t.set_user_attr("pid", os.getpid())
            values, name = dict(t.user_attrs["overrides"]), t.user_attrs["dir"]
            d = root / name
            if d.is_dir() and not checkpoint_steps(d):
                shutil.rmtree(d)  # killed before its first checkpoint: it starts over
            cfg = apply_overrides(plan.base, values)
            trials.append(Trial(name, values, cfg))
            by_dir[name] = t
        write_manifest(plan, root, study)
        with Heartbeat(study, batch if heartbeat else [], search.heartbeat_interval):
            preempted = _train_batch(
                trials, by_dir, study, root, search, parallel, progress, stop_after, tally, log
            )
        if preempted:
            log("search: stopped by a signal; run the same command again to resume the study")
            break
    results = collect_and_write(root)
    results["outcomes"] = tally
    results["best"] = write_best(study, plan, root, log)
    write_plots(study, root, log)
    log(summary_line(tally))
    return results


def _train_batch(
    trials, by_dir, study, root, search, parallel, progress, stop_after, tally, log
) -> bool:
    optuna = _optuna()
    reported = {
        name: set(study._storage.get_trial(t._trial_id).intermediate_values)
        for name, t in by_dir.items()
    }

    def on_eval(run, record):
        name, value = run.workdir.name, record.get(search.metric)
        trial = by_dir.get(name)
        if trial is None or value is None:
            return False
        if record["step"] not in reported[name]:
            trial.report(float(value), int(record["step"]))
            reported[name].add(record["step"])
        return int(record["step"]) < int(run.cfg.train.steps) and trial.should_prune()

    preempted = False
    for group in group_trials(trials, parallel):
        todo = list(group.trials)
        mode = group.mode if len(todo) > 1 else "sequential"
        log(f"search: training {', '.join(t.name for t in todo)} ({mode})")
        train = run_stacked if mode == "vmap" else run_one_by_one
        local = dict.fromkeys(OUTCOMES, 0)
        preempted = (
            train(
                todo,
                root,
                progress=progress,
                stop_after=stop_after,
                log=log,
                tally=local,
                on_eval=on_eval,
            )
            or preempted
        )
        for k, v in local.items():
            tally[k] += v
        for t in todo:
            status = json.loads((root / t.name / "status.json").read_text())["status"]
            trial = by_dir[t.name]
            if status == "finished":
                value = final_value(root / t.name, search.metric)
                if value is None:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                else:
                    study.tell(trial, value)
            elif status == "pruned":
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            elif status == "failed":
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            else:  # "stopped" (a signal, or stop_after): it stays RUNNING, to resume
                preempted = True
        if preempted:
            break
    return preempted


def load_sweep(config: str, overrides: Sequence[str] = (), *, max_trials=None):
    """The plan of the ``sweep(variant=None)`` defined next to ``get_config`` in ``config``:
    a ``Plan``, or a ``SearchPlan`` when it returns an Optuna search."""
    path_text, _, variant = config.partition(":")
    path = pathlib.Path(path_text)
    if path.suffix != ".py" or not path.exists():
        raise ExperimentError(f"--config: {path} is not an experiment file (experiments/NAME.py)")
    module = experiment.import_experiment(path)  # once: it may register attention variants
    fn = getattr(module, "sweep", None)
    if fn is None:
        raise ExperimentError(f"{path} defines no sweep(variant=None) function")
    spec = fn(variant or None) if inspect.signature(fn).parameters else fn()
    if is_search(spec):  # an Optuna search instead of a list of trials
        plan = plan_search(config, overrides, spec)
        if max_trials is not None:
            search = dataclasses.replace(plan.search, num_trials=int(max_trials))
            plan = dataclasses.replace(plan, search=search)
        return plan
    return plan_sweep(config, overrides, spec, max_trials=max_trials)
