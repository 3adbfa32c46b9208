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

from attnlab import experiment
from attnlab.devices import rows, sharding
from attnlab.errors import DivergenceError
from attnlab.runs import extend as extending
from attnlab.runs import surgery_run as surgery
from attnlab.runs.checkpoint import PreemptionGuard
from attnlab.runs.files import METRICS_FILE, SAMPLES_FILE
from attnlab.runs.preflight import preflight
from attnlab.runs.progress import Progress
from attnlab.runs.sampling import sample_text
from attnlab.runs.tracking import Profiler, Tracker, describe, summary
from attnlab.train import injected_hyperparams, lora, lr_multiplier, zeros_acc

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


def open_runs(cfgs, workdirs, *, step=None, allow_changes=False, extend=False):
    """Opens each run and builds its trainer (its own seed and initialisation).

    Everything is checked before any run's directory is locked and written (``Run.begin``).
    ``step`` is the checkpoint to resume from, or a list of them (one per run); ``extend``
    trains a resumed run on to its new ``train.steps`` with its schedule's shape kept
    (``attnlab.runs.extend``).
    """
    runs, trainers = [], []
    steps = step if isinstance(step, list | tuple) else [step] * len(cfgs)
    try:
        mesh = sharding.mesh_from_config(cfgs[0])
        for cfg, workdir, at in zip(cfgs, workdirs, steps, strict=True):
            cfg = surgery.resolve(cfg, workdir)  # a surgery run's model: the result
            cfg, consent = extending.resolve(cfg, workdir, step=at, extend=extend)
            mcfg = experiment.validate(cfg)
            allow = allow_changes or consent
            run, trainer = preflight(cfg, workdir, mcfg, mesh, step=at, allow_changes=allow)
            run.saved_cfg = extending.saved(workdir)  # for the schedule's line on resuming
            runs.append(run)
            trainers.append(trainer)
        for run in runs:
            run.begin()
            run.tracker = Tracker(run.cfg, run.workdir, start_step=run.start or 0)
    except BaseException:
        for run in runs:
            if getattr(run, "tracker", None) is not None:
                run.tracker.close()
            run.close(discard=True)  # nothing trained: the directory as it was
        raise
    return runs, trainers


def divergence(trainer, run, acc, params, step) -> DivergenceError | None:
    """The error of a run whose steps since the last log line (``acc``, on the host) or
    whose trained ``params`` (a LoRA run's adapters) are not finite; None when the state may
    be saved."""
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
    run.failure = divergence(trainer, run, acc, lora.trained(state), step)
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
    loop = _Loop(trainer, runs, stacked, on_eval)
    # Every leaf committed to where it lies, as the step's outputs and the accumulators
    # reset at each log are: a jitted step is compiled again for each mix of committed
    # and uncommitted arguments (three compilations of the same step otherwise).
    state = jax.tree.map(lambda x: x if x.committed else jax.device_put(x, x.sharding), state)
    cfg, total = runs[0].cfg, trainer.total_steps
    # The loop holds the state's leaves and rebuilds the state only where it reads it.
    leaves, treedef = jax.tree.flatten(state)
    train_step = trainer.flat_train_step(treedef, stacked=stacked)
    bar = Progress(runs[0].start, total, progress, hide=NOT_PRINTED.get(cfg.data.kind, ()))
    with PreemptionGuard() as guard:
        step = runs[0].start
        while step < total and loop.active():
            if profiler is not None:
                profiler.before(step + 1)
            leaves, _ = train_step(leaves, loop.batch(step))
            step += 1
            if profiler is not None:
                profiler.after(step, leaves)
            loop.window_steps += 1
            do_eval = bool(loop.eval_batches) and (
                step % cfg.eval.every_steps == 0 or step == total
            )
            for _, r in loop.active():
                r.record, r.step = None, step
            do_log = step % cfg.train.log_every_steps == 0 or do_eval or step == total
            do_save = step % cfg.checkpoint.every_steps == 0 or step == total
            do_stop = guard.requested or (stop_after is not None and step >= stop_after)
            logged = []
            if do_log or do_save or do_stop:
                state = jax.tree.unflatten(treedef, leaves)
                logged = loop.log(state, step, do_eval) if do_log else []
                if do_save:
                    loop.save(state, step)
                if do_stop:
                    loop.stop(state, step, guard.signal_name or f"stop_after={stop_after}")
                    bar.update(1, logged)
                    bar.close()
                    return guard.requested
                leaves = jax.tree.leaves(state)  # the log resets the accumulators in place
            bar.update(1, logged)
    bar.close()
    return False


class _Loop:
    """What ``_loop`` does at each kind of step, for one run or stacked runs."""

    def __init__(self, trainer, runs, stacked, on_eval):
        self.trainer, self.runs, self.stacked, self.on_eval = trainer, runs, stacked, on_eval
        cfg = runs[0].cfg
        e, self.batch_size = cfg.eval, int(cfg.train.batch_size)
        self.eval_batches = runs[0].eval_batches  # built and checked by preflight
        if self.eval_batches is None:
            self.eval_batches = (
                runs[0].task.eval_batches(int(e.batch_size), int(e.batches)) if e.batches else []
            )
        self.tokens_per_step = self.batch_size * int(cfg.data.seq_len)
        self.lr_at = lr_multiplier(cfg.optim, trainer.total_steps)
        # This process's rows of the batch, the ones its devices hold.
        self.rows = rows.process_rows(self.batch_size, trainer.mesh, trainer.rules)
        self.window_start, self.window_steps = time.perf_counter(), 0

    def view(self, tree, i):
        """Run ``i``'s part of a stacked tree (the tree itself for one run)."""
        return jax.tree.map(lambda x: x[i], tree) if self.stacked else tree

    def active(self):
        return [(i, r) for i, r in enumerate(self.runs) if r.failure is None]

    def _local(self, x):
        """This process's rows: text tasks read them alone, the others give every row."""
        return x[self.rows] if x.shape[0] == self.batch_size else x

    def batch(self, step):
        runs, B = self.runs, self.batch_size
        if not self.stacked:
            return jax.tree.map(
                self._local, runs[0].task.train_batch(int(runs[0].cfg.train.seed), step, B)
            )
        parts = [r.task.train_batch(int(r.cfg.train.seed), step, B) for r in runs]
        return jax.tree.map(lambda *xs: np.stack([self._local(x) for x in xs]), *parts)

    def _empty_acc(self):
        acc = zeros_acc(self.trainer.mcfg, self.trainer.metrics)
        if not self.stacked:
            return acc
        # One copy per run of each empty accumulator (a largest value's starts at -inf).
        return jax.tree.map(lambda z: jnp.repeat(z[None], len(self.runs), axis=0), acc)

    def log(self, state, step, do_eval) -> list:
        """Each active run's record (and evaluation, sample, pruning); the accumulators
        reset. Returns ``(name, record)`` of the runs that logged, for the progress bar."""
        acc = jax.device_get(state["acc"])
        peak_lr = jax.device_get(injected_hyperparams(state["opt_state"])["learning_rate"])
        window = time.perf_counter() - self.window_start
        # Fresh accumulators where the old ones lie (global arrays on a mesh).
        state["acc"] = jax.tree.map(
            lambda z, old: jax.device_put(z, old.sharding), self._empty_acc(), state["acc"]
        )
        evals = None
        if do_eval:
            weights = self.trainer.weights(state)  # a LoRA run's: its adapters merged
            evals = self.trainer.evaluate(weights, self.eval_batches, stacked=self.stacked)
            evals = evals if self.stacked else [evals]
        logged = []
        for i, r in self.active():
            r.elapsed += window
            a = self.view(acc, i)
            record = {
                "step": step,
                "train_loss": float(a["loss_sum"] / max(a["tokens"], 1.0)),
                "learning_rate": float(self.view(peak_lr, i) * self.lr_at(step - 1)),
                "grad_norm": float(a["grad_norm_sum"] / max(int(a["steps"]), 1)),
                "tokens_per_sec": self.window_steps * self.tokens_per_step / max(window, 1e-9),
                "elapsed_sec": r.elapsed,
            }
            if int(a["nonfinite"]) and not self.trainer.skip_nonfinite:
                # The record that shows the divergence (non-finite steps are not
                # accumulated, so the loss is marked); no checkpoint follows it.
                r.log({**record, "train_loss": math.nan}, METRICS_FILE)
                r.failure = divergence(self.trainer, r, a, None, step)
                continue
            if self.trainer.skip_nonfinite:
                record["skipped_steps"] = int(a["nonfinite"])
            record.update(self.trainer.metric_records(a))  # the registered metrics
            if do_eval:
                record.update(evals[i])
                self._sample(weights, i, r, step)
            r.log(record, METRICS_FILE)
            r.tracker.metrics(record)
            r.record = record
            logged.append((r.workdir.name if self.stacked else "", record))
            if do_eval and self.on_eval is not None and self.on_eval(r, record):
                save_checked(self.trainer, r, step, self.view(state, i))
                r.failure = r.failure or Pruned(f"pruned at step {step}")
                if self.stacked:
                    mask_row(state["opt_state"], i)
        self.window_start, self.window_steps = time.perf_counter(), 0
        return logged

    def _sample(self, weights, i, r, step):
        text = sample_text(self.trainer, r.task, self.view(weights, i), r.cfg, step)
        if text is not None:
            r.log({"step": step, "text": text}, SAMPLES_FILE)
            r.tracker.sample(step, text)

    def save(self, state, step):
        for i, r in self.active():
            save_checked(self.trainer, r, step, self.view(state, i))

    def stop(self, state, step, why):
        """Checkpoints every active run where it stands (unless just saved) and says so."""
        for i, r in self.active():
            if r.ckpt.latest_step() != step:
                # Steps past the last log line stay in ``acc``, which is saved too.
                save_checked(self.trainer, r, step, self.view(state, i))
        runs = self.runs
        where = runs[0].workdir if len(runs) == 1 else runs[0].workdir.parent
        print(f"stopped at step {step} ({why}); checkpoint saved in {where}", flush=True)


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
    extend=False,
):
    """Opens, restores and trains the runs; stacked runs at different steps train in turn.

    A lone run prints a header first and a summary at the end (``verbose``: the shardings
    too, and one line per attention fallback, ``attnlab.ops.flex.log_fallbacks``). Returns
    the ``Run`` objects (closed) and whether a signal stopped the training.
    """
    wall = time.perf_counter()
    if verbose:  # each attention path that falls back says so when the step is built
        from attnlab.ops.flex import log_fallbacks

        log_fallbacks()
    runs, trainers = open_runs(
        cfgs, workdirs, step=step, allow_changes=allow_changes, extend=extend
    )
    profiler = Profiler(runs[0].cfg, runs[0].workdir)
    speak = len(runs) == 1 and jax.process_index() == 0
    failed = False
    try:
        if speak:
            print(describe(runs[0], trainers[0], verbose=verbose), flush=True)
        if speak and verbose and runs[0].eval_batches:  # what each layer's attention runs
            from attnlab.runs.lowering import train_plan

            batch, rows = runs[0].eval_batches[0], int(runs[0].cfg.train.batch_size)
            for line in train_plan(trainers[0], batch, rows):
                print(f"attention plan: {line}", flush=True)
        abstract = trainers[0].abstract_state()
        states = [r.initial_state(tr, abstract) for r, tr in zip(runs, trainers, strict=True)]
        for r in runs:  # a resume with another train.steps: what the schedule does
            note = extending.schedule_note(getattr(r, "saved_cfg", None), r.cfg, r.start)
            if note and speak:
                print(note, flush=True)
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
    except BaseException:
        failed = True
        raise
    finally:
        profiler.stop()
        for r in runs:
            r.tracker.close()
            # A run that failed before its first step leaves its directory as it was.
            r.close(discard=failed and (r.start is None or r.step <= r.start))


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
    extend: bool = False,
) -> dict:
    """Trains (or resumes) the experiment ``cfg`` in ``workdir``; returns the final record.

    ``stop_after`` stops (with a checkpoint) once that many steps are done, as a preemption
    would: used to test exact resumption. ``step`` resumes from that checkpoint (default: the
    newest readable one); ``allow_changes`` resumes with changed optimiser/training values;
    ``extend`` trains a resumed run on to a changed ``train.steps`` with the schedule's shape
    kept (``attnlab.runs.extend``).
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
        extend=extend,
    )
    if isinstance(run.failure, Pruned):
        return {**(run.record or {"step": run.step}), "pruned": True}
    if run.failure is not None:
        raise run.failure
    return run.record or {"step": run.step}
