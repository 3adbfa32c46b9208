"""A run's work directory: its files, written so that a crash never leaves half a file.

``DIR/config.json`` is the resolved config (``attnlab train --config DIR/config.json``
repeats the run), ``DIR/metrics.jsonl`` and ``DIR/samples.jsonl`` hold one JSON record per
logged step, ``DIR/checkpoints/`` the orbax checkpoints. A resumed run first drops the records
logged after its checkpoint, so they are logged again exactly once.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax

from attnlab import experiment
from attnlab.checkpoint import Checkpointer
from attnlab.config import ModelConfig
from attnlab.data import make_task

METRICS_FILE, SAMPLES_FILE, CONFIG_FILE = "metrics.jsonl", "samples.jsonl", "config.json"


def is_writer() -> bool:
    """Only process 0 writes a run's logs, metrics, samples and config (every process
    writes its own checkpoint shards)."""
    return jax.process_index() == 0


def atomic_write(path: pathlib.Path, text: str):
    """Writes ``text`` to ``path`` through a temporary file and a rename."""
    if not is_writer():
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def truncate_jsonl(path: pathlib.Path, last_step: int):
    """Drops records logged after ``last_step`` (they will be logged again on resume)."""
    if not path.exists() or not is_writer():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= last_step
    ]
    atomic_write(path, "".join(line + "\n" for line in kept))


def append_jsonl(path: pathlib.Path, record: dict):
    if not is_writer():
        return
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def check_config(workdir: pathlib.Path, cfg):
    """Refuses a work directory that holds a run of another model or data config."""
    saved_path = workdir / CONFIG_FILE
    if not saved_path.exists():
        return
    saved = json.loads(saved_path.read_text())
    # Compared as JSON would hold them (tuples are lists there).
    now = {g: json.loads(json.dumps(cfg[g].to_dict())) for g in ("model", "data")}
    if any(saved.get(g) != now[g] for g in now):
        diff = sorted(
            f"{g}.{k}"
            for g in now
            for k in set(saved.get(g, {})) | set(now[g])
            if saved.get(g, {}).get(k) != now[g].get(k)
        )
        raise experiment.ExperimentError(
            f"{workdir} holds a run with a different model/data config (differs in {diff}); "
            "use a new --workdir, or repeat the run with --config "
            f"{saved_path}"
        )


def _host() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


class Run:
    """One run's work directory: its config, task, checkpoints, logs and where it stands."""

    def __init__(self, cfg, workdir, mcfg: ModelConfig):
        self.cfg, self.workdir = cfg, pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        check_config(self.workdir, cfg)
        atomic_write(self.workdir / CONFIG_FILE, experiment.to_json(cfg))
        self.task = make_task(cfg.data, self.workdir, host=_host())
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
        """A fresh train state, or the latest checkpoint's (dropping later log records)."""
        if self.start is None:
            self.start = 0
            return trainer.init_state()
        state = self.ckpt.restore(abstract, self.start)
        self.elapsed = float(self.ckpt.restore_metadata(self.start).get("elapsed_sec", 0.0))
        truncate_jsonl(self.workdir / METRICS_FILE, self.start)
        truncate_jsonl(self.workdir / SAMPLES_FILE, self.start)
        if self.start >= int(self.cfg.train.steps):
            print(
                f"already finished: {self.workdir} holds step {self.start} of "
                f"{int(self.cfg.train.steps)}; raise train.steps to train on",
                flush=True,
            )
        else:
            print(f"resuming from step {self.start} in {self.workdir}", flush=True)
        return state

    def save(self, step, state):
        meta = {"elapsed_sec": self.elapsed, "step": step}
        self.ckpt.save(step, state, metadata=meta, force=True)

    def log(self, record: dict, file: str = METRICS_FILE):
        append_jsonl(self.workdir / file, record)
