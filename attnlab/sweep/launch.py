"""Sweeps on a scheduler: one job per trial through ``submitit``, a SLURM job array.

``launch_sweep(plan, DIR, launcher="slurm")`` submits the trials that still need work as one
job array (``"local"``: submitit's local executor, one process per trial on this machine),
waits for them and collects ``DIR/results.*`` exactly as ``run_sweep`` does. Each job trains
its trial with the same code as ``attnlab sweep --parallel sequential``, so the files are
the same. Resources come from ``--partition``, ``--timeout-min``, ... flags, on top of an
optional ``sweep_resources(variant=None)`` dict in the experiment file (submitit's
parameter names: ``timeout_min``, ``slurm_partition``, ``gpus_per_node``, ``cpus_per_task``,
``mem_gb``, ``slurm_array_parallelism``, ...). Job logs go to ``DIR/submitit/``.
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import socket

from attnlab import experiment
from attnlab.experiment import ExperimentError
from attnlab.sweep.plan import Plan, Trial
from attnlab.sweep.results import collect_and_write
from attnlab.sweep.run import (
    OUTCOMES,
    plan_actions,
    run_one_by_one,
    summary_line,
    trial_action,
    write_manifest,
)

LAUNCHERS = ("inprocess", "local", "slurm")
JOB_FILE = "job.json"
_FLAGS = {  # flag dest -> submitit parameter
    "partition": "slurm_partition",
    "timeout_min": "timeout_min",
    "gpus_per_node": "gpus_per_node",
    "cpus_per_task": "cpus_per_task",
    "mem_gb": "mem_gb",
    "array_parallelism": "slurm_array_parallelism",
}


def add_arguments(parser) -> None:
    """The ``--launcher`` and resource flags of ``attnlab sweep``."""
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="inprocess",
        help="inprocess (default), local (one process per trial) or slurm (a job array)",
    )
    parser.add_argument("--partition", default=None, help="SLURM partition")
    parser.add_argument("--timeout-min", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--cpus-per-task", type=int, default=None)
    parser.add_argument("--mem-gb", type=float, default=None)
    parser.add_argument("--array-parallelism", type=int, default=None, help="jobs at once")


def resources_from_args(args, plan: Plan) -> dict:
    """The experiment file's ``sweep_resources(variant)``, then the flags given."""
    path, _, variant = plan.config.partition(":")
    module = experiment.import_experiment(path)
    fn = getattr(module, "sweep_resources", None)
    resources = {}
    if fn is not None:
        resources = dict(fn(variant or None) if inspect.signature(fn).parameters else fn())
    for dest, name in _FLAGS.items():
        if getattr(args, dest, None) is not None:
            resources[name] = getattr(args, dest)
    return resources


def train_trial(cfg_json: str, root: str, name: str, overrides: dict) -> dict:
    """Runs in the job: trains one trial as the sequential sweep would; what ran where."""
    cfg = experiment.from_json(cfg_json)
    experiment.register_variants(cfg)
    trial_dir = pathlib.Path(root) / name
    trial_dir.mkdir(parents=True, exist_ok=True)
    from attnlab.sweep import slurm

    where = {"pid": os.getpid(), "host": socket.gethostname()}
    where["job_id"] = slurm.job_id() or os.environ.get("SUBMITIT_JOB_ID")
    where["restarts"] = int(os.environ.get("SLURM_RESTART_COUNT", 0))  # requeued runs
    (trial_dir / JOB_FILE).write_text(json.dumps(where) + "\n")
    trial = Trial(name, overrides, cfg)
    # the submitting process refused what cannot run; here the trial trains or extends
    action = trial_action(trial, trial_dir, retry_failed=True, allow_changes=True)
    stopped = run_one_by_one(
        [trial],
        pathlib.Path(root),
        progress=False,
        stop_after=None,
        log=print,
        actions={name: action},
    )
    if stopped:  # a signal (a preemption): the checkpoint is written; run again from it
        slurm.requeue()
    return where


def _submit(executor, launcher, resources, fn, *columns):
    """``executor.map_array`` with SLURM's refusal (a partition, a resource) in one line."""
    import submitit

    if launcher == "slurm":
        from attnlab.sweep import slurm

        slurm.check_partition((resources or {}).get("slurm_partition"))
    try:
        return executor.map_array(fn, *columns)
    except submitit.core.utils.FailedJobError as e:
        lines = [ln for ln in str(e).splitlines() if "error" in ln.lower()] or [str(e)]
        why = lines[-1].strip()
        raise ExperimentError(f"--launcher {launcher}: the submission failed: {why}") from None


def _wait(jobs, names, launcher, log):
    """Waits for the jobs (SLURM's: saying when each is queued, running, finished); logs
    each job that failed."""
    if launcher == "slurm":
        from attnlab.sweep import slurm

        slurm.wait(jobs, names, log)
    for name, job in zip(names, jobs, strict=True):
        if launcher == "slurm" and not job.paths.result_pickle.exists():
            log(f"{name}: job {job.job_id} ended without a result; see {job.paths.stderr}")
            continue
        try:
            job.result()
        except Exception as e:  # the job itself died: its log says why
            log(f"{name}: job {job.job_id} failed: {str(e).splitlines()[0]}")


def search_worker(cfg_path: str, overrides: list, root: str, storage, study_name) -> dict:
    """Runs in a job: one worker of an Optuna search, on the shared study."""
    from attnlab.sweep.search import load_sweep, run_search

    plan = load_sweep(cfg_path, overrides)
    run_search(plan, root, storage=storage, study_name=study_name, log=print)
    return {"pid": os.getpid(), "host": socket.gethostname()}


def launch_search(
    plan,
    workdir,
    *,
    launcher: str = "local",
    resources: dict | None = None,
    workers: int = 1,
    storage: str | None = None,
    study_name: str | None = None,
    log=print,
) -> dict:
    """Submits ``workers`` jobs that share the search's study, waits, collects the results.

    Workers on several hosts need a database every host reaches (``storage``: a PostgreSQL
    or MySQL URL); the default SQLite file suits workers on one machine."""
    import submitit

    from attnlab.sweep.search import default_storage, open_study, redact
    from attnlab.sweep.search_report import write_best, write_plots

    if launcher not in ("local", "slurm"):
        raise ExperimentError(f"--launcher={launcher!r}: use 'local' or 'slurm' here")
    root = pathlib.Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    storage = storage or default_storage(root)
    study = open_study(plan, root, storage, study_name)  # created once, before the workers
    executor = submitit.AutoExecutor(folder=root / "submitit", cluster=launcher)
    executor.update_parameters(name=pathlib.Path(plan.config).stem, **(resources or {}))
    n = max(int(workers), 1)
    jobs = _submit(
        executor,
        launcher,
        resources,
        search_worker,
        [plan.config] * n,
        [list(plan.base_overrides)] * n,
        [str(root)] * n,
        [storage] * n,
        [study.study_name] * n,
    )
    log(f"search: {n} worker(s) submitted ({launcher}) on {redact(storage)}")
    _wait(jobs, [f"worker {i}" for i in range(n)], launcher, log)
    results = collect_and_write(root)
    results["best"] = write_best(study, plan, root, log)
    write_plots(study, root, log)
    return results


def launch_sweep(
    plan: Plan,
    workdir,
    *,
    launcher: str = "local",
    resources: dict | None = None,
    retry_failed: bool = False,
    allow_changes: bool = False,
    log=print,
) -> dict:
    """Submits the unfinished trials as one job array, waits, collects the results."""
    import submitit

    if launcher not in ("local", "slurm"):
        raise ExperimentError(f"--launcher={launcher!r}: use 'local' or 'slurm' here")
    root = pathlib.Path(workdir).resolve()
    actions = plan_actions(plan, root, retry_failed=retry_failed, allow_changes=allow_changes)
    write_manifest(plan, root)
    todo, tally = [], dict.fromkeys(OUTCOMES, 0)
    for t in plan.trials:
        if actions[t.name].kind == "skip":
            log(f"skip {t.name} ({actions[t.name].why})")
            tally["skipped"] += 1
        else:
            todo.append(t)
    if todo:
        executor = submitit.AutoExecutor(folder=root / "submitit", cluster=launcher)
        executor.update_parameters(name=pathlib.Path(plan.config).stem, **(resources or {}))
        jobs = _submit(
            executor,
            launcher,
            resources,
            train_trial,
            [experiment.to_json(t.cfg) for t in todo],
            [str(root)] * len(todo),
            [t.name for t in todo],
            [t.overrides for t in todo],
        )
        log(f"sweep: {len(jobs)} trial(s) submitted ({launcher}): {jobs[0].job_id.split('_')[0]}")
        _wait(jobs, [t.name for t in todo], launcher, log)
    results = collect_and_write(root)
    rows = {r["trial"]: r["status"] for r in results["trials"]}
    for t in todo:
        status = rows.get(t.name, "failed")
        tally[status if status in tally else "stopped"] += 1
    results["outcomes"] = tally
    log(summary_line(tally))
    return results
