"""One stage of an attention transfer: a few parameters trained against a frozen teacher.

A stage's state is ``{"trainable", "opt_state", "step"}``: ``trainable`` holds only what the
stage trains, ``{"params": {path: array}, "lora": adapters}`` (the new mixers' parameters
in stage 1; LoRA adapters, and optionally more, in stage 2). The student's parameters are
``base`` with those leaves put in and the adapters merged (``assemble``); ``base`` and the
teacher's parameters are arguments of the jitted step, never differentiated and without
optimiser state. The step runs the teacher (gradients stopped) and the student on the same
batch, in one program, and descends ``attnlab.train.distill.objective``.

On a ``mesh`` of more than one device (the run's ``mesh`` group) the step is the same
program over it: the batch split over the batch axes, the student's base and the teacher's
parameters placed by the sharding rules, what trains replicated; GSPMD adds the collectives.

Each stage keeps its own directory (``DIR/<stage>/``): orbax checkpoints (every
``checkpoint_every`` steps and at the end) and ``metrics.jsonl`` (one line per logged step,
with the per-layer attention MSE); a stage that finds a checkpoint resumes from it exactly
(batches are a function of ``(seed, step)``), one that is finished is not run again.
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from attnlab.devices import sharding
from attnlab.runs.checkpoint import Checkpointer
from attnlab.train import distill, lora, programs
from attnlab.train.lora import path_name

DONE = "done.json"


def assemble(base, trainable: dict, lora_spec=None, key=None):
    """``base`` with ``trainable["params"]`` put in by path and its adapters merged."""
    put = trainable.get("params") or {}
    params = jax.tree_util.tree_map_with_path(lambda p, x: put.get(path_name(p), x), base)
    if lora_spec is not None and trainable.get("lora"):
        params = lora.merge(lora_spec, params, trainable["lora"], key)
    return params


def select(params, names) -> dict:
    """``{path: leaf}`` of ``params`` for the dotted ``names``."""
    flat = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    return {n: flat[n] for n in sorted(names)}


def optimizer(lr: float, steps: int, warmup: int, clip: float = 1.0):
    """AdamW (no decay) with linear warmup and cosine decay to a tenth."""
    warmup = max(min(warmup, steps - 1), 1)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched, weight_decay=0.0))


class Batches:
    """Windows of ``seq_len + 1`` tokens at offsets drawn from ``(seed, step)``."""

    def __init__(self, ids, seq_len: int, batch_size: int, seed: int):
        self.ids, self.seq_len, self.batch_size, self.seed = ids, seq_len, batch_size, seed

    def __call__(self, step: int) -> dict:
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.ids) - self.seq_len - 1, self.batch_size)
        rows = np.stack([self.ids[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)
        return window_batch(rows)


def window_batch(rows) -> dict:
    return {
        "inputs": rows[:, :-1],
        "targets": rows[:, 1:],
        "loss_mask": np.ones(rows[:, 1:].shape, np.float32),
    }


def eval_batches(ids, seq_len: int, batch_size: int, batches: int) -> list[dict]:
    """``batches`` fixed batches of windows spread evenly over ``ids``."""
    n = batch_size * batches
    starts = np.linspace(0, len(ids) - seq_len - 2, n).astype(int)
    rows = np.stack([ids[s : s + seq_len + 1] for s in starts]).astype(np.int32)
    return [window_batch(rows[i * batch_size : (i + 1) * batch_size]) for i in range(batches)]


class Stage:
    """Trains ``trainable`` (see the module docstring) for ``steps`` steps."""

    def __init__(
        self,
        name,
        workdir,
        *,
        student_cfg,
        teacher_cfg,
        spec,
        lora_spec=None,
        lr,
        steps,
        warmup,
        mse_layers=(),
        seed=0,
        log_every=10,
        checkpoint_every=100,
        mesh=None,
        rules=None,
    ):
        self.name, self.dir = name, pathlib.Path(workdir) / name
        self.spec, self.lora_spec = spec, lora_spec
        self.steps, self.log_every, self.checkpoint_every = steps, log_every, checkpoint_every
        self.mse_layers, self.n_layers = tuple(mse_layers), teacher_cfg.n_layers
        self.seed = seed
        from attnlab.nn.models import build_model

        abstract = lambda c: nnx.eval_shape(lambda: build_model(c, rngs=nnx.Rngs(0)))
        self.student_graph = nnx.graphdef(abstract(student_cfg))
        self.teacher_graph = nnx.graphdef(abstract(teacher_cfg))
        self.names = distill.teacher_names(spec, self.n_layers, self.mse_layers)
        self.tx = optimizer(lr, steps, warmup)
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.rules = rules if rules is not None else sharding.resolve_rules()
        self._step = programs.on_mesh(
            jax.jit(self._train_step, donate_argnums=0), self.mesh, self.rules
        )

    def place(self, params, *, replicate: bool = False):
        """``params`` on the mesh (by the sharding rules, or replicated); as they are without."""
        if self.mesh is None:
            return params
        if replicate:
            return jax.device_put(params, NamedSharding(self.mesh, PartitionSpec()))
        return jax.device_put(params, sharding.tree_shardings(params, self.mesh, self.rules))

    def init_state(self, trainable: dict) -> dict:
        trainable = jax.tree.map(jnp.array, trainable)  # a copy: the step donates it
        return {
            "trainable": trainable,
            "opt_state": self.tx.init(trainable),
            "step": jnp.zeros((), jnp.int32),
        }

    def student(self, base, trainable, key=None):
        return nnx.merge(self.student_graph, assemble(base, trainable, self.lora_spec, key))

    def _train_step(self, state, base, teacher_params, batch):
        key = jax.random.fold_in(jax.random.key(self.seed), state["step"])
        teacher = None
        if self.spec.needs_teacher:
            tmodel = nnx.merge(self.teacher_graph, teacher_params)
            teacher = distill.teacher_pass(tmodel, batch["inputs"], self.names)

        def loss_fn(trainable):
            model = self.student(base, trainable, key)
            return distill.objective(
                self.spec, model, batch, teacher, mse_layers=self.mse_layers, n_layers=self.n_layers
            )

        (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"])
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["trainable"])
        new = {
            "trainable": optax.apply_updates(state["trainable"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }
        return new, {"loss": loss, **parts, "grad_norm": optax.tree.norm(grads)}

    def done(self) -> bool:
        return (self.dir / DONE).is_file()

    def run(self, trainable, base, teacher_params, batches, *, stop_after=None, say=print):
        """Trains from ``trainable`` (or resumes); returns the final trainable leaves."""
        state = self.place(self.init_state(trainable), replicate=True)
        base, teacher_params = self.place(base), self.place(teacher_params)
        metrics_file = self.dir / "metrics.jsonl"
        with Checkpointer(self.dir / "checkpoints", max_to_keep=2) as ckpt:
            if self.done():
                return self.local(ckpt.restore(state, ckpt.latest_step())["trainable"])
            start = ckpt.latest_step() or 0
            if start:
                state = self.place(ckpt.restore(state), replicate=True)
                say(f"{self.name}: resuming at step {start}")
            _truncate(metrics_file, start)
            t0 = time.perf_counter()
            for step in range(start, self.steps):
                state, m = self._step(state, base, teacher_params, batches(step))
                last = step + 1 == self.steps
                if (step + 1) % self.log_every == 0 or step == 0 or last:
                    rec = {"step": step + 1, **_floats(jax.device_get(m))}
                    rec["elapsed_sec"] = round(time.perf_counter() - t0, 2)
                    _append(metrics_file, rec)
                    say(f"{self.name} step {step + 1}/{self.steps} loss {rec['loss']:.4g}")
                if (step + 1) % self.checkpoint_every == 0 or last:
                    ckpt.save(step + 1, state)
                if stop_after is not None and step + 1 - start >= stop_after and not last:
                    ckpt.save(step + 1, state)
                    return None
            (self.dir / DONE).write_text(json.dumps({"steps": self.steps}))
        return self.local(state["trainable"])

    def local(self, tree):
        """``tree`` off the mesh, on the default device (what the evaluation reads)."""
        if self.mesh is None:
            return tree
        return jax.tree.map(jnp.asarray, jax.device_get(tree))


def _floats(m: dict) -> dict:
    out = {}
    for k, v in m.items():
        v = np.asarray(v)
        out[k] = float(v) if v.ndim == 0 else [float(x) for x in v]
    return out


def _append(path: pathlib.Path, rec: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _truncate(path: pathlib.Path, last_step: int):
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines() if json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in keep))


def trainable_count(trainable: dict) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(trainable)))
