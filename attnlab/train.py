"""Objectives, pure train/eval steps, and the training loop.

``train_step(state, batch) -> (state, metrics)`` and ``eval_step(params, batch)`` are pure
functions of pytrees, jitted once by ``Trainer`` (the state buffers are donated). The train
state is a dict ``{"params", "opt_state", "step", "acc", "key"}``: ``acc`` accumulates the loss and
gradient norm between log lines *inside* the state, so a run resumed from a checkpoint logs
exactly what the uninterrupted run logs. Dropout keys are ``fold_in(key(seed), step)``, with
the seed's key data kept in the state so stacked trials can each carry their own.

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
    hyper = next(
        s for s in jax.tree.leaves(opt_state, is_leaf=_is_injected) if _is_injected(s)
    ).hyperparams
    return hyper["learning_rate"] * lr_multiplier(o, total_steps)(step)


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

    def evaluate(self, params, batches):
        totals = None
        for b in batches:
            m = self.eval_step(params, b)
            totals = m if totals is None else jax.tree.map(jnp.add, totals, m)
        t = jax.device_get(totals)
        return {
            "eval_loss": float(t["loss_sum"] / max(t["tokens"], 1.0)),
            "eval_accuracy": float(t["correct"] / max(t["tokens"], 1.0)),
            "eval_exact_match": float(t["rows_ok"] / max(t["rows"], 1.0)),
        }


# The loop ------------------------------------------------------------------------------------
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
    """A tqdm bar on a terminal, plain log lines otherwise."""

    def __init__(self, start, total, enabled):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, n, record=None):
        if self.bar is not None:
            self.bar.update(n)
            if record:
                self.bar.set_postfix(
                    {k: f"{v:.4g}" for k, v in record.items() if k in ("train_loss", "eval_loss")}
                )
        elif record:
            fields = " ".join(
                f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
            )
            print(fields, flush=True)

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
    """A short sample from a language model (None for other tasks)."""
    if trainer.kind != "lm" or task.tokenizer is None or cfg.eval.sample_tokens <= 0:
        return None
    from attnlab.decode import generate

    prompt = cfg.eval.sample_prompt or task.decode(task.val_ids[:1])
    ids = task.encode(prompt)
    room = trainer.mcfg.max_len - len(ids)
    n = min(int(cfg.eval.sample_tokens), room)
    if n <= 0:
        return None
    result = generate(
        trainer.model(params),
        ids[None, :],
        n,
        temperature=float(cfg.eval.sample_temperature),
        seed=int(cfg.train.seed) * 1_000_003 + step,
    )
    return prompt + task.decode(result.tokens[0])


def train(cfg, workdir, *, progress: bool = True, stop_after: int | None = None) -> dict:
    """Trains (or resumes) the experiment ``cfg`` in ``workdir``; returns the final record.

    ``stop_after`` stops (with a checkpoint) once that many steps are done, as a preemption
    would: used to test exact resumption.
    """
    mcfg = experiment.validate(cfg)
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    _check_workdir_config(workdir, cfg)
    _atomic_write(workdir / CONFIG_FILE, experiment.to_json(cfg))

    task = make_task(cfg.data, workdir)
    if task.vocab_size > mcfg.vocab_size:
        raise experiment.ExperimentError(
            f"model.vocab_size={mcfg.vocab_size} is smaller than the data's vocabulary "
            f"({task.vocab_size} ids); set --config.model.vocab_size={task.vocab_size}"
        )
    trainer = Trainer(cfg, mcfg, kind=task.kind)
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=int(cfg.checkpoint.max_to_keep))
    state, elapsed = trainer.init_state(), 0.0
    start = ckpt.latest_step()
    if start is not None:
        state = ckpt.restore(trainer.abstract_state(), start)
        elapsed = float(ckpt.restore_metadata(start).get("elapsed_sec", 0.0))
        _truncate_jsonl(workdir / METRICS_FILE, start)
        _truncate_jsonl(workdir / SAMPLES_FILE, start)
        print(f"resuming from step {start} in {workdir}", flush=True)
    start = int(start or 0)
    t, e = cfg.train, cfg.eval
    eval_batches = task.eval_batches(int(e.batch_size), int(e.batches)) if e.batches else []
    tokens_per_step = int(t.batch_size) * int(cfg.data.seq_len)

    def save(step):
        ckpt.save(step, state, metadata={"elapsed_sec": elapsed, "step": step}, force=True)

    record = {}
    bar = _Progress(start, trainer.total_steps, progress)
    window_start, window_steps = time.perf_counter(), 0
    with PreemptionGuard() as guard:
        step = start
        while step < trainer.total_steps:
            batch = task.train_batch(int(t.seed), step, int(t.batch_size))
            state, _ = trainer.train_step(state, batch)
            step += 1
            window_steps += 1
            do_eval = bool(eval_batches) and (
                step % e.every_steps == 0 or step == trainer.total_steps
            )
            do_log = step % t.log_every_steps == 0 or do_eval or step == trainer.total_steps
            record = None
            if do_log:
                acc = jax.device_get(state["acc"])
                now = time.perf_counter()
                elapsed += now - window_start
                record = {
                    "step": step,
                    "train_loss": float(acc["loss_sum"] / max(acc["tokens"], 1.0)),
                    "learning_rate": float(
                        learning_rate(state["opt_state"], cfg.optim, trainer.total_steps, step - 1)
                    ),
                    "grad_norm": float(acc["grad_norm_sum"] / max(int(acc["steps"]), 1)),
                    "tokens_per_sec": window_steps
                    * tokens_per_step
                    / max(now - window_start, 1e-9),
                    "elapsed_sec": elapsed,
                }
                state["acc"] = _zeros_acc()
                if do_eval:
                    record.update(trainer.evaluate(state["params"], eval_batches))
                    text = sample_text(trainer, task, state["params"], cfg, step)
                    if text is not None:
                        _append_jsonl(workdir / SAMPLES_FILE, {"step": step, "text": text})
                if not math.isfinite(record["train_loss"]):
                    save_reason = f"non-finite training loss at step {step}"
                    _append_jsonl(workdir / METRICS_FILE, record)
                    raise FloatingPointError(save_reason)
                _append_jsonl(workdir / METRICS_FILE, record)
                window_start, window_steps = time.perf_counter(), 0
            bar.update(1, record)
            if step % cfg.checkpoint.every_steps == 0 or step == trainer.total_steps:
                save(step)
            if guard.requested or (stop_after is not None and step >= stop_after):
                if ckpt.latest_step() != step:
                    # Steps past the last log line stay in ``acc``, which is saved too.
                    save(step)
                why = guard.signal_name or f"stop_after={stop_after}"
                print(f"stopped at step {step} ({why}); checkpoint saved in {workdir}", flush=True)
                break
    bar.close()
    ckpt.close()
    return record or {"step": step}


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
