"""Objectives, pure train/eval steps, and the training loop.

``train_step(state, batch) -> (state, metrics)`` and ``eval_step(params, batch)`` are pure
functions of pytrees, jitted once by ``Trainer`` (the state buffers are donated). The train
state is a dict ``{"params", "opt_state", "step", "acc", "key"}``: ``acc`` accumulates the loss and
gradient norm between log lines *inside* the state, so a run resumed from a checkpoint logs
exactly what the uninterrupted run logs. Dropout keys are ``fold_in(key(seed), step)``, with
the seed's key data kept in the state so stacked trials can each carry their own.

``train_stacked`` trains runs that differ only in ``STACKABLE`` values (seed, peak learning
rate, weight decay, Adam's b1/b2/eps, init scale) as one program: each run is initialised
alone, then every state leaf is stacked on a leading trial axis and ``jax.vmap`` of the same
step trains them all; each run's files are written as if it had trained alone.

The optimiser is AdamW with global-norm clipping, a decay mask (no decay on norms, biases,
embeddings and position tables unless ``optim.decay_embeddings``), and warmup + cosine decay.
The peak learning rate and weight decay sit in the optimiser state
(``optax.inject_hyperparams``), so trials that differ only in them can share one program.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from attnlab import experiment
from attnlab.checkpoint import Checkpointer, PreemptionGuard
from attnlab.config import ModelConfig
from attnlab.data import make_task
from attnlab.nn import build_model

METRICS_FILE, SAMPLES_FILE, CONFIG_FILE = "metrics.jsonl", "samples.jsonl", "config.json"
NO_DECAY_NAMES = ("embedding", "table", "token_types", "bias")


# Objectives ---------------------------------------------------------------------------------
def model_logits(model, batch, kind, key=None):
    """Logits and the matching (targets, loss mask) for a batch of ``kind``."""
    if kind == "lm":
        out = model(batch["inputs"], key=key)
        return out.logits, batch["targets"], batch["loss_mask"]
    if kind == "mlm":
        out = model(batch["inputs"], valid_BT=batch["valid"], key=key)
        return out.logits, batch["targets"], batch["loss_mask"]
    if kind == "seq2seq":
        out = model(batch["src"], batch["tgt_in"], src_valid_BS=batch["src_valid"], key=key)
        return out.logits, batch["tgt_out"], batch["loss_mask"]
    raise ValueError(f"unknown task kind {kind!r}")


def loss_sums(model, batch, kind, key=None):
    """Summed masked cross-entropy and the number of counted tokens."""
    logits_BTV, targets_BT, mask_BT = model_logits(model, batch, kind, key)
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
    mask_BT = mask_BT.astype(jnp.float32)
    return (ce_BT * mask_BT).sum(), mask_BT.sum(), (logits_BTV, targets_BT, mask_BT)


# Optimiser -------------------------------------------------------------------------------
def lr_multiplier(o, total_steps: int):
    """The schedule as a multiplier of the peak learning rate, a function of the step."""
    warmup = max(int(o.warmup_steps), 0)
    decay_steps = max(total_steps - warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (step + 1.0) / max(warmup, 1)) if warmup else 1.0
        frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        if o.schedule == "cosine":
            decay = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        elif o.schedule == "linear":
            decay = 1.0 - (1.0 - o.min_lr_ratio) * frac
        else:
            decay = jnp.ones_like(frac)
        return jnp.where(step < warmup, warm, decay)

    return schedule


def decay_mask(params, decay_embeddings: bool = False):
    """True for weights that take weight decay: matrices, but not norms/biases/embeddings."""

    def decide(path, x):
        name = jax.tree_util.keystr(path)
        if x.ndim < 2:
            return False
        return decay_embeddings or not any(n in name for n in NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(o, total_steps: int, params):
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=o.learning_rate,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        mask=decay_mask(params, o.decay_embeddings),
    )
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    return optax.chain(*parts, adamw, optax.scale_by_schedule(lr_multiplier(o, total_steps)))


def learning_rate(opt_state, o, total_steps, step):
    """The learning rate applied at ``step`` (peak from the state times the schedule)."""
    return _hyperparams(opt_state)["learning_rate"] * lr_multiplier(o, total_steps)(step)


def _hyperparams(opt_state):
    return next(
        s for s in jax.tree.leaves(opt_state, is_leaf=_is_injected) if _is_injected(s)
    ).hyperparams


def _is_injected(x):
    return isinstance(x, optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState)


# State and steps -----------------------------------------------------------------------------
def _zeros_acc():
    return {
        "loss_sum": jnp.zeros((), jnp.float32),
        "tokens": jnp.zeros((), jnp.float32),
        "grad_norm_sum": jnp.zeros((), jnp.float32),
        "steps": jnp.zeros((), jnp.int32),
    }


class Trainer:
    """Builds the model and optimiser of an experiment and jits its steps once."""

    def __init__(self, cfg, mcfg: ModelConfig | None = None, *, kind: str = "lm"):
        self.cfg = cfg
        self.mcfg = mcfg or experiment.validate(cfg)
        self.kind = kind
        self.total_steps = int(cfg.train.steps)
        model = build_model(self.mcfg, seed=int(cfg.train.seed))
        self.graphdef, params = nnx.split(model)
        self._init_params = params
        self.tx = make_optimizer(cfg.optim, self.total_steps, params)
        self.accum = int(cfg.optim.grad_accum_steps)
        self.train_step = jax.jit(self._train_step, donate_argnums=0)
        self.eval_step = jax.jit(self._eval_step)
        # Stacked trials: every state leaf has a leading trial axis; eval batches are shared.
        self.stacked_train_step = jax.jit(jax.vmap(self._train_step), donate_argnums=0)
        self.stacked_eval_step = jax.jit(jax.vmap(self._eval_step, in_axes=(0, None)))

    def init_state(self):
        params = self._init_params
        return {
            "params": params,
            "opt_state": self.tx.init(params),
            "step": jnp.zeros((), jnp.int32),
            "acc": _zeros_acc(),
            "key": jax.random.key_data(jax.random.key(int(self.cfg.train.seed))),
        }

    def abstract_state(self):
        return jax.eval_shape(self.init_state)

    def model(self, params):
        return nnx.merge(self.graphdef, params)

    def _grads(self, params, batch, key):
        def f(p):
            s, n, _ = loss_sums(self.model(p), batch, self.kind, key)
            return s, n

        (s, n), g = jax.value_and_grad(f, has_aux=True)(params)
        return s, n, g

    def _train_step(self, state, batch):
        params, step = state["params"], state["step"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["key"]), step)
        if self.accum == 1:
            loss_sum, tokens, grads = self._grads(params, batch, key)
        else:  # accumulate summed gradients over micro-batches, then normalise once
            micro = jax.tree.map(
                lambda x: x.reshape((self.accum, x.shape[0] // self.accum) + x.shape[1:]), batch
            )

            def body(carry, inputs):
                i, mb = inputs
                s, n, g = self._grads(params, mb, jax.random.fold_in(key, i))
                return jax.tree.map(jnp.add, carry, (s, n, g)), None

            zero = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (loss_sum, tokens, grads), _ = jax.lax.scan(body, zero, (jnp.arange(self.accum), micro))
        grads = jax.tree.map(lambda g: g / jnp.maximum(tokens, 1.0), grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, updates)
        acc = state["acc"]
        acc = {
            "loss_sum": acc["loss_sum"] + loss_sum,
            "tokens": acc["tokens"] + tokens,
            "grad_norm_sum": acc["grad_norm_sum"] + grad_norm,
            "steps": acc["steps"] + 1,
        }
        new = {
            "params": params,
            "opt_state": opt_state,
            "step": step + 1,
            "acc": acc,
            "key": state["key"],
        }
        return new, {"loss": loss_sum / jnp.maximum(tokens, 1.0), "grad_norm": grad_norm}

    def _eval_step(self, params, batch):
        s, n, (logits, targets, mask) = loss_sums(self.model(params), batch, self.kind)
        correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32) * mask
        rows_ok = (correct.sum(-1) == mask.sum(-1)).astype(jnp.float32)
        return {
            "loss_sum": s,
            "tokens": n,
            "correct": correct.sum(),
            "rows_ok": rows_ok.sum(),
            "rows": jnp.asarray(mask.shape[0], jnp.float32),
        }

    def evaluate(self, params, batches, *, stacked: bool = False):
        """Validation metrics; with ``stacked``, one dict per index of the leading trial axis."""
        eval_step = self.stacked_eval_step if stacked else self.eval_step
        totals = None
        for b in batches:
            m = eval_step(params, b)
            totals = m if totals is None else jax.tree.map(jnp.add, totals, m)
        t = jax.device_get(totals)
        if not stacked:
            return _eval_record(t)
        return [_eval_record({k: v[i] for k, v in t.items()}) for i in range(len(t["rows"]))]


def _eval_record(t):
    return {
        "eval_loss": float(t["loss_sum"] / max(t["tokens"], 1.0)),
        "eval_accuracy": float(t["correct"] / max(t["tokens"], 1.0)),
        "eval_exact_match": float(t["rows_ok"] / max(t["rows"], 1.0)),
    }


# The loop ------------------------------------------------------------------------------------
# Trials whose configs differ only in these values have the same array shapes and the same
# traced program (the optimiser hyperparameters live in the state, initialisation happens
# before stacking), so they can be stacked on a leading axis and trained by one vmapped step.
STACKABLE = (
    "train.seed",
    "optim.learning_rate",
    "optim.weight_decay",
    "optim.b1",
    "optim.b2",
    "optim.eps",
    "model.init_std",
)


def stack_key(cfg) -> str:
    """The config without its ``STACKABLE`` values: trials with equal keys can be stacked."""
    values = cfg.to_dict()
    for dotted in STACKABLE:
        group, leaf = dotted.split(".")
        values[group].pop(leaf, None)
    return json.dumps(values, sort_keys=True)


def _atomic_write(path: pathlib.Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _truncate_jsonl(path: pathlib.Path, last_step: int):
    """Drops records logged after ``last_step`` (they will be logged again on resume)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= last_step
    ]
    _atomic_write(path, "".join(line + "\n" for line in kept))


def _append_jsonl(path: pathlib.Path, record: dict):
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


class _Progress:
    """A tqdm bar on a terminal, plain log lines otherwise (prefixed by a trial's label)."""

    def __init__(self, start, total, enabled):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, n, records=()):
        if self.bar is not None:
            self.bar.update(n)
            if records:
                self.bar.set_postfix(
                    {
                        k: f"{v:.4g}"
                        for k, v in records[0][1].items()
                        if k in ("train_loss", "eval_loss")
                    }
                )
            return
        for label, record in records:
            fields = " ".join(
                f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
            )
            print(f"[{label}] {fields}" if label else fields, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _check_workdir_config(workdir: pathlib.Path, cfg):
    saved_path = workdir / CONFIG_FILE
    if not saved_path.exists():
        return
    saved = json.loads(saved_path.read_text())
    if saved.get("model") != cfg.model.to_dict() or saved.get("data") != cfg.data.to_dict():
        diff = sorted(
            f"{g}.{k}"
            for g in ("model", "data")
            for k in set(saved.get(g, {})) | set(cfg[g].to_dict())
            if saved.get(g, {}).get(k) != cfg[g].to_dict().get(k)
        )
        raise experiment.ExperimentError(
            f"{workdir} holds a run with a different model/data config (differs in {diff}); "
            "use a new --workdir, or repeat the run with --config "
            f"{saved_path}"
        )


def sample_text(trainer, task, params, cfg, step):
    """A short sample from a language model (None for other tasks); unknown ids are dropped."""
    if trainer.kind != "lm" or task.tokenizer is None or cfg.eval.sample_tokens <= 0:
        return None
    from attnlab.decode import generate
    from attnlab.recompute import generate_by_recompute

    prompt = cfg.eval.sample_prompt or task.decode(task.val_ids[:1])
    ids = task.encode(prompt)
    room = trainer.mcfg.max_len - len(ids)
    n = min(int(cfg.eval.sample_tokens), room)
    if n <= 0:
        return None
    options = dict(
        temperature=float(cfg.eval.sample_temperature), seed=int(cfg.train.seed) * 1_000_003 + step
    )
    if trainer.mcfg.causal:
        tokens = np.asarray(generate(trainer.model(params), ids[None, :], n, **options).tokens[0])
    else:  # the causal-mask ablation: the cached decoder is exact only for causal models
        tokens = generate_by_recompute(trainer.model(params), ids[None, :], n, **options)[0]
    return prompt + decode_known(task, tokens)


def decode_known(task, tokens) -> str:
    """Text of sampled ids, dropping ids the tokenizer lacks (``model.vocab_size`` may exceed
    the task's vocabulary, and such ids have no text)."""
    tokens = np.asarray(tokens)
    return task.decode(tokens[(tokens >= 0) & (tokens < task.vocab_size)])


class _Run:
    """One run's work directory: its config, task, checkpoints, logs and where it stands."""

    def __init__(self, cfg, workdir, mcfg: ModelConfig):
        self.cfg, self.workdir = cfg, pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        _check_workdir_config(self.workdir, cfg)
        _atomic_write(self.workdir / CONFIG_FILE, experiment.to_json(cfg))
        self.task = make_task(cfg.data, self.workdir)
        vocab = self.task.vocab_size
        if vocab > mcfg.vocab_size:
            raise experiment.ExperimentError(
                f"model.vocab_size={mcfg.vocab_size} is smaller than the data's vocabulary "
                f"({vocab} ids); set --config.model.vocab_size={vocab}"
            )
        keep = int(cfg.checkpoint.max_to_keep)
        self.ckpt = Checkpointer(self.workdir / "checkpoints", max_to_keep=keep)
        self.start = self.ckpt.latest_step()
        self.elapsed, self.step = 0.0, 0
        self.record: dict | None = None  # the record logged at the last step, if any
        self.failure: Exception | None = None

    def initial_state(self, trainer, abstract):
        if self.start is None:
            self.start = 0
            return trainer.init_state()
        state = self.ckpt.restore(abstract, self.start)
        self.elapsed = float(self.ckpt.restore_metadata(self.start).get("elapsed_sec", 0.0))
        _truncate_jsonl(self.workdir / METRICS_FILE, self.start)
        _truncate_jsonl(self.workdir / SAMPLES_FILE, self.start)
        print(f"resuming from step {self.start} in {self.workdir}", flush=True)
        return state

    def save(self, step, state):
        meta = {"elapsed_sec": self.elapsed, "step": step}
        self.ckpt.save(step, state, metadata=meta, force=True)


def _open_runs(cfgs, workdirs):
    """Opens each run and builds its trainer (its own seed and initialisation)."""
    runs, trainers = [], []
    try:
        for cfg, workdir in zip(cfgs, workdirs, strict=True):
            mcfg = experiment.validate(cfg)
            runs.append(_Run(cfg, workdir, mcfg))
            trainers.append(Trainer(cfg, mcfg, kind=runs[-1].task.kind))
    except BaseException:
        for run in runs:
            run.ckpt.close()
        raise
    return runs, trainers


def _loop(trainer, runs, state, *, stacked: bool, progress: bool, stop_after) -> bool:
    """Trains ``runs`` from their common start step; True when a signal stopped it.

    With ``stacked`` every leaf of ``state`` has a leading axis indexing ``runs`` and one
    vmapped step trains them all; otherwise ``runs`` is one run. The runs share everything
    but their ``STACKABLE`` values, so they log, evaluate and checkpoint at the same steps.
    Each run's files are written as if it had trained alone.
    """
    cfg, n = runs[0].cfg, len(runs)
    t, e = cfg.train, cfg.eval
    total, batch_size = trainer.total_steps, int(t.batch_size)
    eval_batches = runs[0].task.eval_batches(int(e.batch_size), int(e.batches)) if e.batches else []
    tokens_per_step = batch_size * int(cfg.data.seq_len)
    train_step = trainer.stacked_train_step if stacked else trainer.train_step
    lr_at = lr_multiplier(cfg.optim, total)

    def view(tree, i):
        return jax.tree.map(lambda x: x[i], tree) if stacked else tree

    def batch(step):
        if not stacked:
            return runs[0].task.train_batch(int(t.seed), step, batch_size)
        parts = [r.task.train_batch(int(r.cfg.train.seed), step, batch_size) for r in runs]
        return jax.tree.map(lambda *xs: np.stack(xs), *parts)

    def zeros_acc():
        acc = _zeros_acc()
        return jax.tree.map(lambda z: jnp.zeros((n,) + z.shape, z.dtype), acc) if stacked else acc

    def active():
        return [(i, r) for i, r in enumerate(runs) if r.failure is None]

    start = runs[0].start
    bar = _Progress(start, total, progress)
    window_start, window_steps = time.perf_counter(), 0
    stopped_by_signal = False
    with PreemptionGuard() as guard:
        step = start
        while step < total and active():
            state, _ = train_step(state, batch(step))
            step += 1
            window_steps += 1
            do_eval = bool(eval_batches) and (step % e.every_steps == 0 or step == total)
            do_log = step % t.log_every_steps == 0 or do_eval or step == total
            logged = []
            for _, r in active():
                r.record, r.step = None, step
            if do_log:
                acc = jax.device_get(state["acc"])
                peak_lr = jax.device_get(_hyperparams(state["opt_state"])["learning_rate"])
                now = time.perf_counter()
                window = now - window_start
                state["acc"] = zeros_acc()
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
                    if do_eval:
                        record.update(evals[i])
                    if not math.isfinite(record["train_loss"]):
                        _append_jsonl(r.workdir / METRICS_FILE, record)
                        r.failure = FloatingPointError(f"non-finite training loss at step {step}")
                        continue
                    if do_eval:
                        text = sample_text(trainer, r.task, view(state["params"], i), r.cfg, step)
                        if text is not None:
                            _append_jsonl(r.workdir / SAMPLES_FILE, {"step": step, "text": text})
                    _append_jsonl(r.workdir / METRICS_FILE, record)
                    r.record = record
                    logged.append((r.workdir.name if stacked else "", record))
                window_start, window_steps = time.perf_counter(), 0
            bar.update(1, logged)
            if step % cfg.checkpoint.every_steps == 0 or step == total:
                for i, r in active():
                    r.save(step, view(state, i))
            if guard.requested or (stop_after is not None and step >= stop_after):
                for i, r in active():
                    if r.ckpt.latest_step() != step:
                        # Steps past the last log line stay in ``acc``, which is saved too.
                        r.save(step, view(state, i))
                why = guard.signal_name or f"stop_after={stop_after}"
                where = runs[0].workdir if n == 1 else runs[0].workdir.parent
                print(f"stopped at step {step} ({why}); checkpoint saved in {where}", flush=True)
                stopped_by_signal = guard.requested
                break
    bar.close()
    return stopped_by_signal


def _train_runs(cfgs, workdirs, *, stacked, progress, stop_after):
    """Opens, restores and trains the runs; stacked runs at different steps train in turn."""
    runs, trainers = _open_runs(cfgs, workdirs)
    try:
        abstract = trainers[0].abstract_state()
        states = [r.initial_state(tr, abstract) for r, tr in zip(runs, trainers, strict=True)]
        by_start: dict[int, list[int]] = {}
        for i, r in enumerate(runs):
            by_start.setdefault(r.start, []).append(i)
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
            if _loop(
                trainers[0], sub, state, stacked=stacked, progress=progress, stop_after=stop_after
            ):
                return runs, True
        return runs, False
    finally:
        for r in runs:
            r.ckpt.close()


def train(cfg, workdir, *, progress: bool = True, stop_after: int | None = None) -> dict:
    """Trains (or resumes) the experiment ``cfg`` in ``workdir``; returns the final record.

    ``stop_after`` stops (with a checkpoint) once that many steps are done, as a preemption
    would: used to test exact resumption. A non-finite training loss raises
    ``FloatingPointError`` once its record is logged.
    """
    (run,), _ = _train_runs(
        [cfg], [workdir], stacked=False, progress=progress, stop_after=stop_after
    )
    if run.failure is not None:
        raise run.failure
    return run.record or {"step": run.step}


def train_stacked(cfgs, workdirs, *, progress: bool = True, stop_after: int | None = None):
    """Trains (or resumes) several runs that differ only in ``STACKABLE`` values at once.

    Each run is initialised from its own config, then params, optimiser state (with its
    hyperparameters), step, accumulators and RNG key data are stacked on a leading axis and
    trained by one jitted, vmapped step; every step stacks each run's own batch. Each
    ``workdirs[i]`` ends up as ``train(cfgs[i], workdirs[i])`` would leave it. A run whose
    loss turns non-finite is dropped from the logs and checkpoints; the others go on.

    Returns one dict per run: ``status`` ("finished", "stopped" or "failed"), ``reason``,
    ``step``, ``record`` (the final log record, if any) and ``preempted``.
    """
    cfgs = list(cfgs)
    keys = {stack_key(c) for c in cfgs}
    if len(keys) > 1:
        raise experiment.ExperimentError(
            f"train_stacked: the configs differ in more than {', '.join(STACKABLE)}; "
            "train them separately"
        )
    runs, preempted = _train_runs(
        cfgs, workdirs, stacked=True, progress=progress, stop_after=stop_after
    )
    out = []
    for r in runs:
        if r.failure is not None:
            status, reason = "failed", f"{type(r.failure).__name__}: {r.failure}"
        else:
            status = "finished" if r.step >= int(r.cfg.train.steps) else "stopped"
            reason = None
        out.append(
            {
                "workdir": str(r.workdir),
                "status": status,
                "reason": reason,
                "step": r.step,
                "record": r.record,
                "preempted": preempted,
            }
        )
    return out


def load_run(workdir):
    """(cfg, trainer, task, params, step) of the latest checkpoint in ``workdir``."""
    workdir = pathlib.Path(workdir)
    path = workdir / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {workdir} an attnlab work directory?")
    cfg = experiment.from_json(path.read_text())
    task = make_task(cfg.data, workdir)
    trainer = Trainer(cfg, kind=task.kind)
    with Checkpointer(workdir / "checkpoints") as ckpt:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir / 'checkpoints'}")
        state = ckpt.restore(trainer.abstract_state(), step)
    return cfg, trainer, task, state["params"], step


def evaluate(workdir) -> dict:
    """Evaluates the latest checkpoint of a run on its validation split."""
    cfg, trainer, task, params, step = load_run(workdir)
    batches = task.eval_batches(int(cfg.eval.batch_size), max(int(cfg.eval.batches), 1))
    return {"step": step, **trainer.evaluate(params, batches)}
