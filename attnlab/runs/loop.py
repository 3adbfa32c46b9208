"""The training loop: one run, or several stacked runs, from their checkpoints to the end.

Every ``train.log_every_steps`` (and at each evaluation and the last step) each run appends a
record to its ``metrics.jsonl``; evaluations also append a sample to ``samples.jsonl`` for
language models. Checkpoints are written every ``checkpoint.every_steps``, at the end and when
a signal (SIGTERM/SIGINT) or ``stop_after`` stops the loop.

Divergence: the step counts non-finite losses and gradient norms on device
(``acc["nonfinite"]``); the loop reads the count where it syncs anyway, at log lines and
before every checkpoint, and never writes a checkpoint of a state that saw one (or whose
parameters are not finite). With ``train.on_nonfinite="stop"`` the run stops with a
``DivergenceError`` naming the step and the last good checkpoint, which is kept; with
``"skip"`` such steps change nothing and are counted in the records (``skipped_steps``).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import experiment, sharding
from attnlab.checkpoint import PreemptionGuard
from attnlab.errors import DivergenceError
from attnlab.runs.progress import Progress
from attnlab.runs.sampling import sample_text
from attnlab.runs.tracking import Profiler, Tracker, describe, summary
from attnlab.runs.workdir import METRICS_FILE, SAMPLES_FILE, Run
from attnlab.train import Trainer, injected_hyperparams, lr_multiplier, zeros_acc
from attnlab.train.router_metrics import router_record

# Metrics of the evaluation that mean nothing for a task: not printed (still logged).
NOT_PRINTED = {"text": ("eval_exact_match",)}


class Pruned(Exception):
    """A run stopped early by the caller's ``on_eval`` (a search's pruner); not a failure."""


def mask_row(opt_state, i):
    """Stops row ``i`` of a stacked state from changing its parameters: its learning rates
    become 0 in the optimiser state (the program and every other row stay as they are)."""
    hyper = injected_hyperparams(opt_state)
    for name in ("learning_rate", "adam_learning_rate"):
        if name in hyper:
            old = hyper[name]
            hyper[name] = jax.device_put(old.at[i].set(0), old.sharding)


def open_runs(cfgs, workdirs, *, step=None, allow_changes=False):
    """Opens each run and builds its trainer (its own seed and initialisation).

    Everything is checked before any run's directory is locked and written (``Run.begin``).
    ``step`` is the checkpoint to resume from, or a list of them (one per run).
    """
    runs, trainers = [], []
    steps = step if isinstance(step, list | tuple) else [step] * len(cfgs)
    try:
        mesh = sharding.mesh_from_config(cfgs[0])
        for cfg, workdir, at in zip(cfgs, workdirs, steps, strict=True):
            mcfg = experiment.validate(cfg)
            runs.append(Run(cfg, workdir, mcfg, step=at, allow_changes=allow_changes))
            trainers.append(Trainer(cfg, mcfg, kind=runs[-1].task.kind, mesh=mesh))
        for run in runs:
            run.begin()
            run.tracker = Tracker(run.cfg, run.workdir, start_step=run.start or 0)
    except BaseException:
        for run in runs:
            run.close()
            if getattr(run, "tracker", None) is not None:
                run.tracker.close()
        raise
    return runs, trainers


def divergence(trainer, run, acc, params, step) -> DivergenceError | None:
    """The error of a run whose steps since the last log line (``acc``, on the host) or
    whose ``params`` are not finite; None when the state may be saved."""
    bad = int(acc["nonfinite"]) > 0 and not trainer.skip_nonfinite
    if not bad and bool(trainer.all_finite(params)):
        return None
    at = int(acc["first_nonfinite"]) if bad else step
    last = run.ckpt.latest_step()
    what = "training loss or gradient norm" if bad else "parameters"
    where = f"step {last} in {run.ckpt.directory} (kept)" if last is not None else "none"
    return DivergenceError(
        f"training diverged: non-finite {what} at step {at}; the last good checkpoint is "
        f"{where}. Lower "
        "--config.optim.learning_rate (resume with --allow-changes), or pass "
        "--config.train.on_nonfinite=skip to skip such steps"
    )


def save_checked(trainer, run, step, state):
    """Saves ``state`` unless it diverged, in which case the run fails and nothing is written."""
    acc = jax.device_get(state["acc"])
    run.failure = divergence(trainer, run, acc, state["params"], step)
    if run.failure is None:
        run.save(step, state)
    else:  # the record that shows the divergence (sweeps collect the run as failed)
        loss = float(acc["loss_sum"] / max(float(acc["tokens"]), 1.0))
        run.log({"step": step, "train_loss": loss if not math.isfinite(loss) else math.nan})


def _loop(
    trainer, runs, state, *, stacked, progress, stop_after, profiler=None, on_eval=None
) -> bool:
    """Trains ``runs`` from their common start step; True when a signal stopped it.

    ``on_eval(run, record)``, called after each evaluation of each run, returns True to
    stop that run (``Pruned``): it is checkpointed where it stands and, stacked, its row is
    masked (``mask_row``) while the others train on.

    With ``stacked`` every leaf of ``state`` has a leading axis indexing ``runs`` and one
    vmapped step trains them all; otherwise ``runs`` is one run. The runs share everything
    but their stackable values, so they log, evaluate and checkpoint at the same steps.
    Each run's files are written as if it had trained alone.
    """
    cfg, n = runs[0].cfg, len(runs)
    t, e = cfg.train, cfg.eval
    total, batch_size = trainer.total_steps, int(t.batch_size)
    # Every leaf committed to where it lies, as the step's outputs and the accumulators
    # reset at each log are: a jitted step is compiled again for each mix of committed
    # and uncommitted arguments (three compilations of the same step otherwise).
    state = jax.tree.map(lambda x: x if x.committed else jax.device_put(x, x.sharding), state)
    eval_batches = runs[0].task.eval_batches(int(e.batch_size), int(e.batches)) if e.batches else []
    tokens_per_step = batch_size * int(cfg.data.seq_len)
    train_step = trainer.stacked_train_step if stacked else trainer.train_step
    lr_at = lr_multiplier(cfg.optim, total)

    def view(tree, i):
        return jax.tree.map(lambda x: x[i], tree) if stacked else tree

    rows = sharding.process_rows(batch_size)  # this process's rows of the global batch

    def local(x):
        """This process's rows: text tasks read them alone, the others give every row."""
        return x[rows] if x.shape[0] == batch_size else x

    def batch(step):
        if not stacked:
            return jax.tree.map(local, runs[0].task.train_batch(int(t.seed), step, batch_size))
        parts = [r.task.train_batch(int(r.cfg.train.seed), step, batch_size) for r in runs]
        return jax.tree.map(lambda *xs: np.stack([local(x) for x in xs]), *parts)

    def empty_acc():
        acc = zeros_acc(trainer.mcfg)
        return jax.tree.map(lambda z: jnp.zeros((n,) + z.shape, z.dtype), acc) if stacked else acc

    def active():
        return [(i, r) for i, r in enumerate(runs) if r.failure is None]

    start = runs[0].start
    bar = Progress(start, total, progress, hide=NOT_PRINTED.get(cfg.data.kind, ()))
    window_start, window_steps = time.perf_counter(), 0
    stopped_by_signal = False
    with PreemptionGuard() as guard:
        step = start
        while step < total and active():
            if profiler is not None:
                profiler.before(step + 1)
            state, _ = train_step(state, batch(step))
            step += 1
            if profiler is not None:
                profiler.after(step, state)
            window_steps += 1
            do_eval = bool(eval_batches) and (step % e.every_steps == 0 or step == total)
            do_log = step % t.log_every_steps == 0 or do_eval or step == total
            logged = []
            for _, r in active():
                r.record, r.step = None, step
            if do_log:
                acc = jax.device_get(state["acc"])
                peak_lr = jax.device_get(injected_hyperparams(state["opt_state"])["learning_rate"])
                now = time.perf_counter()
                window = now - window_start
                # Fresh accumulators where the old ones lie (global arrays on a mesh).
                state["acc"] = jax.tree.map(
                    lambda z, old: jax.device_put(z, old.sharding), empty_acc(), state["acc"]
                )
                evals = None
                if do_eval:
                    evals = trainer.evaluate(state["params"], eval_batches, stacked=stacked)
                    evals = evals if stacked else [evals]
                for i, r in active():
                    r.elapsed += window
                    a = view(acc, i)
                    record = {
                        "step": step,
                        "train_loss": float(a["loss_sum"] / max(a["tokens"], 1.0)),
                        "learning_rate": float(view(peak_lr, i) * lr_at(step - 1)),
                        "grad_norm": float(a["grad_norm_sum"] / max(int(a["steps"]), 1)),
                        "tokens_per_sec": window_steps * tokens_per_step / max(window, 1e-9),
                        "elapsed_sec": r.elapsed,
                    }
                    if int(a["nonfinite"]) and not trainer.skip_nonfinite:
                        # The record that shows the divergence (non-finite steps are not
                        # accumulated, so the loss is marked); no checkpoint follows it.
                        r.log({**record, "train_loss": math.nan}, METRICS_FILE)
                        r.failure = divergence(trainer, r, a, None, step)
                        continue
                    if trainer.skip_nonfinite:
                        record["skipped_steps"] = int(a["nonfinite"])
                    record.update(router_record(a))
                    if do_eval:
                        record.update(evals[i])
                    if do_eval:
                        text = sample_text(trainer, r.task, view(state["params"], i), r.cfg, step)
                        if text is not None:
                            r.log({"step": step, "text": text}, SAMPLES_FILE)
                            r.tracker.sample(step, text)
                    r.log(record, METRICS_FILE)
                    r.tracker.metrics(record)
                    r.record = record
                    logged.append((r.workdir.name if stacked else "", record))
                    if do_eval and on_eval is not None and on_eval(r, record):
                        save_checked(trainer, r, step, view(state, i))
                        r.failure = r.failure or Pruned(f"pruned at step {step}")
                        if stacked:
                            mask_row(state["opt_state"], i)
                window_start, window_steps = time.perf_counter(), 0
            bar.update(1, logged)
            if step % cfg.checkpoint.every_steps == 0 or step == total:
                for i, r in active():
                    save_checked(trainer, r, step, view(state, i))
            if guard.requested or (stop_after is not None and step >= stop_after):
                for i, r in active():
                    if r.ckpt.latest_step() != step:
                        # Steps past the last log line stay in ``acc``, which is saved too.
                        save_checked(trainer, r, step, view(state, i))
                why = guard.signal_name or f"stop_after={stop_after}"
                where = runs[0].workdir if n == 1 else runs[0].workdir.parent
                print(f"stopped at step {step} ({why}); checkpoint saved in {where}", flush=True)
                stopped_by_signal = guard.requested
                break
    bar.close()
    return stopped_by_signal


def train_runs(
    cfgs,
    workdirs,
    *,
    stacked,
    progress,
    stop_after,
    step=None,
    allow_changes=False,
    verbose=False,
    on_eval=None,
):
    """Opens, restores and trains the runs; stacked runs at different steps train in turn.

    A lone run prints a header first and a summary at the end (``verbose``: the shardings
    too). Returns the ``Run`` objects (closed) and whether a signal stopped the training.
    """
    wall = time.perf_counter()
    runs, trainers = open_runs(cfgs, workdirs, step=step, allow_changes=allow_changes)
    profiler = Profiler(runs[0].cfg, runs[0].workdir)
    speak = len(runs) == 1 and jax.process_index() == 0
    try:
        if speak:
            print(describe(runs[0], trainers[0], verbose=verbose), flush=True)
        abstract = trainers[0].abstract_state()
        states = [r.initial_state(tr, abstract) for r, tr in zip(runs, trainers, strict=True)]
        first = [(r.start, r.elapsed) for r in runs]
        by_start: dict[int, list[int]] = {}
        for i, r in enumerate(runs):
            by_start.setdefault(r.start, []).append(i)
        stopped = False
        for start in sorted(by_start):
            idx = by_start[start]
            for i in idx:
                runs[i].step = start
            state = states[idx[0]]
            if stacked:
                state = jax.tree.map(lambda *xs: jnp.stack(xs), *[states[i] for i in idx])
            for i in idx:
                states[i] = None  # the loop owns (and donates) the state from here on
            sub = [runs[i] for i in idx]
            stopped = _loop(
                trainers[0],
                sub,
                state,
                stacked=stacked,
                progress=progress,
                stop_after=stop_after,
                profiler=profiler,
                on_eval=on_eval,
            )
            if stopped:
                break
        if speak and runs[0].failure is None:
            (start, elapsed), r = first[0], runs[0]
            took = time.perf_counter() - wall
            print(summary(r, wall=took, steps=r.step - start, seconds=r.elapsed - elapsed))
        return runs, stopped
    finally:
        profiler.stop()
        for r in runs:
            r.close()
            r.tracker.close()


def train(
    cfg,
    workdir,
    *,
    progress: bool = True,
    stop_after: int | None = None,
    step: int | None = None,
    allow_changes: bool = False,
    verbose: bool = False,
    on_eval=None,
) -> dict:
    """Trains (or resumes) the experiment ``cfg`` in ``workdir``; returns the final record.

    ``stop_after`` stops (with a checkpoint) once that many steps are done, as a preemption
    would: used to test exact resumption. ``step`` resumes from that checkpoint (default: the
    newest readable one); ``allow_changes`` resumes with changed optimiser/training values.
    A diverging run raises ``DivergenceError`` (see the module docstring). ``verbose``
    prints the shardings in the header; ``on_eval(run, record) -> bool`` may stop the run
    after an evaluation (its final record then has ``"pruned": True``).
    """
    (run,), _ = train_runs(
        [cfg],
        [workdir],
        stacked=False,
        progress=progress,
        stop_after=stop_after,
        step=step,
        allow_changes=allow_changes,
        verbose=verbose,
        on_eval=on_eval,
    )
    if isinstance(run.failure, Pruned):
        return {**(run.record or {"step": run.step}), "pruned": True}
    if run.failure is not None:
        raise run.failure
    return run.record or {"step": run.step}
