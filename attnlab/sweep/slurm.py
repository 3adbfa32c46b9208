"""What SLURM says about a sweep's jobs, checks before submitting, and requeueing on preemption.

``states(ids)`` asks ``squeue`` for the jobs still queued or running and ``sacct`` for the
others (``scontrol show job`` where the cluster keeps no accounting: it remembers a job for
``MinJobAge`` seconds after its end), each state in one word of ``WORDS``: queued, running,
finished or failed. ``wait`` polls them, prints each change in one line, and returns when
every job has ended; a job seen running and then queued again was requeued, and ``wait``
lets it start again at once rather than after SLURM's two-minute hold. ``check_partition``
refuses a partition the cluster does not have before anything is submitted. A trial
stopped by a signal inside a SLURM job (SIGTERM from ``scancel --signal=TERM`` or a
preemption) has written its checkpoint; ``requeue`` puts the job back in the queue, and the
next start resumes the trial from that checkpoint.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from attnlab.errors import ConfigError, one_line

TIMEOUT_S = 30  # the longest any SLURM command may take before the controller counts as gone
WORDS = {
    "queued": ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "CONFIGURING", "RESIZING"),
    "running": ("RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED"),
    "finished": ("COMPLETED",),
}  # anything else (FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...) is "failed"


def word(state: str) -> str:
    """``queued``, ``running``, ``finished`` or ``failed`` for a SLURM job state."""
    state = state.split()[0].rstrip("+").upper() if state.strip() else "PENDING"
    return next((w for w, names in WORDS.items() if state in names), "failed")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    if shutil.which(argv[0]) is None:
        raise ConfigError(
            f"--launcher slurm: {argv[0]} is not on PATH; run on a SLURM login node, or use "
            "--launcher local"
        )
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"--launcher slurm: `{' '.join(argv[:2])}` got no answer in {TIMEOUT_S} s; is "
            "slurmctld running (scontrol ping)?"
        ) from None


def check_partition(partition: str | None) -> None:
    """Refuses a partition that ``sinfo`` does not list (None: the cluster's default)."""
    out = _run(["sinfo", "-h", "-o", "%R"])
    if out.returncode:
        raise ConfigError(
            f"--launcher slurm: sinfo failed ({one_line(out.stderr) or out.returncode}); is "
            "slurmctld running (scontrol ping)?"
        )
    known = sorted(set(out.stdout.split()))
    if partition is not None and partition not in known:
        raise ConfigError(
            f"--partition={partition!r}: this SLURM cluster has no such partition; use one of "
            f"{known}"
        )


def _scontrol_states(base: str) -> dict[str, str]:
    out = _run(["scontrol", "show", "job", "-o", base])
    found = {}
    for line in out.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "JobState" not in fields:
            continue
        job = fields.get("JobId", "")
        if fields.get("ArrayTaskId") and fields.get("ArrayJobId"):
            job = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"
        found[job] = fields["JobState"]
    return found


def states(ids) -> dict[str, str]:
    """The SLURM state of each job id (``123`` or an array task ``123_4``); a job no command
    knows any more is absent."""
    ids = list(ids)
    bases = sorted({i.split("_")[0] for i in ids})
    if not ids:
        return {}
    found = {}
    out = _run(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(bases)])
    for line in out.stdout.splitlines():
        job, _, state = line.partition("|")
        found[job.strip()] = state.strip()
    rest = [i for i in ids if i not in found]
    if rest:
        out = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(bases)])
        if out.returncode == 0:  # accounting is on
            for line in out.stdout.splitlines():
                job, _, state = line.partition("|")
                found.setdefault(job.strip(), state.strip())
        else:
            for base in {i.split("_")[0] for i in rest}:
                for job, state in _scontrol_states(base).items():
                    found.setdefault(job, state)
    return {i: found[i] for i in ids if i in found}


def wait(jobs, names, log=print, poll_s: float = 1.0) -> None:
    """Polls ``jobs`` (submitit jobs, one per name) until each has ended, printing
    ``NAME: queued|running|finished|failed (job ID)`` whenever a job's word changes."""
    said: dict[str, str] = {}
    pending = dict(zip(names, jobs, strict=True))
    while pending:
        now = states(j.job_id for j in pending.values())
        for name, job in list(pending.items()):
            w = word(now[job.job_id]) if job.job_id in now else None
            if w is not None and said.get(name) != w:
                log(f"{name}: {w} (job {job.job_id})")
                if w == "queued" and said.get(name) == "running":
                    release(job.job_id)
                said[name] = w
            if w in ("finished", "failed") or (w is None and job.done()):
                del pending[name]
        if pending:
            time.sleep(poll_s)


def release(job: str) -> None:
    """Lets a requeued job start as soon as there is room: SLURM holds a requeued job back
    for two minutes (its begin time), which a preempted trial need not wait."""
    _run(["scontrol", "update", f"JobId={job}", "StartTime=now"])


def job_id() -> str | None:
    """This process's SLURM job (``123`` or ``123_4`` in an array), or None outside one."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def requeue(log=print) -> bool:
    """Puts this process's SLURM job back in the queue, then waits for SLURM to end this
    run of it (the next run resumes from the checkpoint); False outside a SLURM job."""
    job = job_id()
    if job is None or shutil.which("scontrol") is None:
        return False
    out = subprocess.run(
        ["scontrol", "requeue", job], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if out.returncode:  # a preemption with PreemptMode=REQUEUE has requeued it already
        log(f"job {job}: scontrol requeue: {one_line(out.stderr)}")
        return False
    log(f"job {job}: stopped by a signal with its checkpoint written; requeued")
    time.sleep(3600)  # SLURM ends this run of the job (SIGTERM, then SIGKILL) within KillWait
    return True
