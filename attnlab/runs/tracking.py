"""Where metrics go besides ``metrics.jsonl`` (which stays the source of truth), and profiles.

``Tracker`` writes each logged record, the resolved config (as hyperparameters) and samples
to TensorBoard event files in ``DIR/tb`` (``track.tensorboard``, on by default, through
``tensorboardX``) and to Weights & Biases when ``track.wandb_project`` is set
(``track.wandb_mode="offline"`` writes ``DIR/wandb`` without a network). A resumed run purges
TensorBoard events logged after its checkpoint, as ``metrics.jsonl`` drops its records.

``Profiler`` traces the steps ``train.profile_steps="A,B"`` (A to B inclusive) with
``jax.profiler`` into ``DIR/tb/plugins/profile/<time>/``: ``*.xplane.pb`` for TensorBoard's
profile plugin and ``perfetto_trace.json.gz`` for Perfetto.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax

from attnlab import experiment
from attnlab.errors import optional_import

TB_DIR = "tb"
WANDB_DIR = "wandb"  # where wandb.init writes (dir=DIR)


def _flat(values: dict) -> dict:
    """Dotted keys (``experiment.flat_keys``) with scalar values; others as JSON text."""
    scalar = bool | int | float | str
    return {
        k: v if isinstance(v, scalar) else json.dumps(v)
        for k, v in experiment.flat_keys(values).items()
    }


def _summary_writer():
    """``tensorboardX.SummaryWriter`` without importing torch: the package imports torch,
    where it is installed, only to accept its tensors among its inputs (1.9 s of every run's
    start-up on 2 cores), and the records here are Python numbers and text."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which it expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class Tracker:
    """TensorBoard and Weights & Biases writers of one run; ``None`` writers do nothing.

    The writers open at the first record or sample, not before: a run that ends before it
    logs anything (refused after its checks, stopped before its first step, or already
    finished) adds no event file and no ``wandb`` folder to its work directory.
    """

    def __init__(self, cfg, workdir, start_step: int = 0):
        self.workdir = pathlib.Path(workdir)
        self.cfg, self.start_step = cfg, start_step
        track = cfg.get("track") or {}
        self.tb = self.wandb = None
        self._tensorboard = bool(track.get("tensorboard", True))
        self._wandb = None
        if track.get("wandb_project"):  # the package now; its run at the first record
            self._wandb = optional_import("wandb", "cluster", "track.wandb_project")
        self._open = False

    def _start(self):
        """Opens the writers (once) and writes the config of a run from step 0."""
        if self._open:
            return
        self._open = True
        cfg, workdir, start_step = self.cfg, self.workdir, self.start_step
        track = cfg.get("track") or {}
        hparams = _flat(json.loads(experiment.to_json(cfg)))
        if self._tensorboard:
            self.tb = _summary_writer()(str(workdir / TB_DIR), purge_step=start_step or None)
            if not start_step:
                self.tb.add_text("config", f"```\n{experiment.to_json(cfg)}\n```", 0)
                self.tb.add_hparams(
                    {k: v for k, v in hparams.items() if k != "experiment_file"},
                    {},
                    name="hparams",
                    global_step=0,
                )
        if self._wandb is not None:
            self.wandb = self._wandb.init(
                project=track["wandb_project"],
                entity=track.get("wandb_entity") or None,
                mode=track.get("wandb_mode") or "offline",
                dir=str(workdir),
                name=workdir.name,
                id=workdir.name.replace("/", "-")[:64] + "-" + _short_hash(workdir),
                resume="allow",
                config=hparams,
            )

    def metrics(self, record: dict):
        """The record's numbers as scalars; a list of numbers (a metric per layer, per
        expert) as one scalar per index, ``name/i``."""
        self._start()
        step = int(record["step"])
        number = lambda v: isinstance(v, int | float)
        values = {k: v for k, v in record.items() if k != "step" and number(v)}
        for k, v in record.items():
            if isinstance(v, list) and v and all(number(x) for x in v):
                values.update({f"{k}/{i}": x for i, x in enumerate(v)})
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def sample(self, step: int, text: str):
        self._start()
        if self.tb is not None:
            self.tb.add_text("sample", f"```\n{text}\n```", step)
        if self.wandb is not None:
            self.wandb.log({"sample": text}, step=step)

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.tb = self.wandb = None
        self._open = True  # nothing opens after the close


def _short_hash(path) -> str:
    import hashlib

    return hashlib.sha1(str(pathlib.Path(path).resolve()).encode()).hexdigest()[:8]


def parse_steps(text: str) -> tuple[int, int] | None:
    """``"A,B"`` -> (A, B); ``""`` -> None."""
    if not text:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        first = last = None
    if first is None or not 0 < first <= last:
        raise experiment.ExperimentError(
            f"train.profile_steps={text!r} is invalid: use 'A,B' with 0 < A <= B (steps A to B)"
        )
    return first, last


class Profiler:
    """Starts a ``jax.profiler`` trace before step A and stops it after step B."""

    def __init__(self, cfg, workdir):
        self.steps = parse_steps(cfg.train.get("profile_steps", ""))
        self.logdir = str(pathlib.Path(workdir) / TB_DIR)
        self.active = False

    def before(self, step: int):
        """Called with the number of the step about to run (1-based)."""
        if self.steps and step == self.steps[0] and not self.active:
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, state):
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(state)
            self.stop()

    def stop(self):
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def per_core(devices) -> str:
    from attnlab.devices import cpu as cpu_devices

    if cpu_devices.APPLIED and len(devices) > 1 and devices[0].platform == "cpu":
        return f", one per core ({cpu_devices.ENV}=1: one multithreaded device)"
    return ""


def describe(run, trainer, devices=None, *, verbose: bool = False) -> str:
    """The start-of-run header: where, the model, tokens per step, data, and devices and
    mesh only when there are several; ``verbose`` adds the per-device bytes and shardings."""
    from attnlab.nn.models import count_params

    devices = devices or jax.devices()
    task, cfg, t = run.task, run.cfg, run.cfg.train
    batch, seq = int(t.batch_size), int(cfg.data.seq_len)
    data = f"data: {cfg.data.kind}" + (f" from {cfg.data.path}" if cfg.data.path else "")
    if task.train_ids is not None:
        data += (
            f", {task.tokenizer!r}, {len(task.train_ids):,} train / "
            f"{len(task.val_ids):,} validation tokens"
        )
    else:
        data += f", vocabulary {task.vocab_size}"
    lines = [
        f"run: {run.workdir}",
        f"model: {cfg.model.arch}, {count_params(trainer.mcfg):,} parameters",
        f"training: {int(t.steps)} steps of {batch} x {seq} = {batch * seq:,} tokens per step"
        + (f", from step {run.start}" if run.start else ""),
        data,
    ]
    if trainer.lora is not None:
        from attnlab.train import lora

        spec, adapters = trainer.lora, trainer.abstract_state()["lora"]
        lines.append(
            f"lora: rank {spec.rank}, alpha {spec.alpha:g} on {len(adapters)} weights "
            f"({', '.join(spec.targets)}): {lora.count(adapters):,} trained parameters, "
            "the rest frozen"
        )
    if len(devices) > 1 or jax.process_count() > 1 or verbose:
        kinds = sorted({d.device_kind for d in devices})
        lines.append(
            f"devices: {len(devices)} x {', '.join(kinds)} ({jax.default_backend()}), "
            f"{jax.process_count()} process(es)" + per_core(devices)
        )
    if trainer.mesh is not None and (trainer.mesh.size > 1 or verbose):
        from attnlab.devices import sharding

        state = trainer.abstract_state()
        described = sharding.describe(state, trainer.state_shardings, trainer.mesh)
        lines += described if verbose else described[:1]
    return "\n".join(lines)


def summary(run, *, wall: float, steps: int, seconds: float) -> str:
    """The end-of-run lines: final losses, tokens/s over the ``steps`` trained in ``seconds``
    of training, the ``wall`` time of the command, and where the files are."""
    rec = run.record or {}
    tokens = steps * int(run.cfg.train.batch_size) * int(run.cfg.data.seq_len)
    seconds = max(seconds, 1e-9)
    losses = ", ".join(
        f"{name} {rec[key]:.4f}"
        for key, name in (("train_loss", "train loss"), ("eval_loss", "eval loss"))
        if isinstance(rec.get(key), float)
    )
    total = int(run.cfg.train.steps)
    head = "finished" if run.step >= total else "stopped"
    lines = [
        f"{head}: step {run.step} of {total}"
        + (f"; {losses}" if losses else "")
        + (f"; {tokens / seconds:,.0f} tokens/s" if steps else "")
        + f"; {wall:.1f} s wall"
    ]
    d = run.workdir
    latest = run.ckpt.latest_step() if run.ckpt is not None else None
    where = [f"checkpoints {d / 'checkpoints'}" + (f" (step {latest})" if latest else "")]
    if (d / "samples.jsonl").exists():
        where.append(f"samples {d / 'samples.jsonl'}")
    where.append(f"plots: attnlab plot {d} (loss curves), tensorboard --logdir {d / TB_DIR}")
    lines.append("files: " + ", ".join(where))
    return "\n".join(lines)
