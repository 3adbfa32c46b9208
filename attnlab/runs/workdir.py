"""A run's work directory: its files, written so that a crash never leaves half a file.

``DIR/config.json`` is the resolved config (``attnlab train --config DIR/config.json``
repeats the run), ``DIR/metrics.jsonl`` and ``DIR/samples.jsonl`` hold one JSON record per
logged step, ``DIR/checkpoints/`` the orbax checkpoints (a LoRA run's frozen parameters are
``DIR/lora_base/``, its adapters alone ``DIR/lora_adapters.npz``: ``attnlab.runs.files``).
A resumed run first drops the records logged after its checkpoint, so they are logged again
exactly once.

Opening a run writes nothing: the directory, config, data, tokenizer and model are checked
first, and only ``Run.begin`` (once the run is known to start) takes ``DIR/lock`` (an
``fcntl`` lock the system releases when its process dies, so a stale lock never blocks) and
writes ``config.json``, ``tokenizer.json`` and the checkpoint directory; a run that fails
before its first step puts the directory back as ``begin`` found it (``close(discard=True)``;
the checks before are ``attnlab.runs.preflight``'s). A newest checkpoint
that cannot be read is reported in one line and the newest readable one is used; nothing is
deleted: a resumed run moves the unreadable step to ``checkpoints/step_N.corrupt/`` (so it is
never overwritten), ``attnlab eval`` and ``sample`` leave it where it is. A run resumed from an
older step with ``--step N`` checks the steps after ``N`` (their checksums and metadata) and
moves the corrupt ones aside the same way; the readable ones are replaced as it reaches them.
A checkpoint written because a signal stopped the run records it in its metadata
(``"interrupted": "SIGTERM"``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import socket

from attnlab import experiment
from attnlab.config import ModelConfig
from attnlab.data import make_task
from attnlab.data.tasks import TOKENIZER_FILE
from attnlab.devices import sharding
from attnlab.errors import CheckpointError, WorkdirError, one_line
from attnlab.runs import surgery_run as surgery
from attnlab.runs.checkpoint import Checkpointer, stop_signal
from attnlab.runs.files import (
    CHECKPOINTS,
    CONFIG_FILE,
    LOCK_FILE,
    LORA_ADAPTERS,
    METRICS_FILE,
    SAMPLES_FILE,
    check_workdir,
    is_writer,
    restore_newest,
    save_base,
    saved_part,
    set_aside_corrupt,
    set_aside_unfinished,
)
from attnlab.train import lora, set_optim_values

# Values that may change when a run resumes (they change no state and no step's result).
FREE_ON_RESUME = ("name", "experiment_file", "imports", "eval.", "checkpoint.")
FREE_ON_RESUME += ("train.log_every_steps",)
FREE_ON_RESUME += ("train.on_nonfinite",)
# How a launch finds its peers (coordinator, process count and this process's index): each
# process of one run has its own, and a resumed run may start on other hosts.
FREE_ON_RESUME += ("distributed.",)
# Where the run's values live (the mesh, hence the devices and processes): restoring onto
# another mesh moves them and changes none; the resumed run says what changed in one line.
FREE_ON_RESUME += ("mesh.",)


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
    text = path.read_text()
    kept = [
        line for line in text.splitlines() if line.strip() and json.loads(line)["step"] <= last_step
    ]
    if "".join(line + "\n" for line in kept) != text:  # nothing to drop: left as it was
        atomic_write(path, "".join(line + "\n" for line in kept))


def append_jsonl(path: pathlib.Path, record: dict):
    if not is_writer():
        return
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def config_changes(workdir: pathlib.Path, cfg) -> list[str]:
    """``key: saved -> now`` for each value ``cfg`` changes against ``DIR/config.json``."""
    path = workdir / CONFIG_FILE
    if not path.is_file():
        return []
    try:
        # on today's defaults: a key added since the run was saved is no change
        saved = experiment.flat_keys(
            json.loads(experiment.to_json(experiment.from_json(path.read_text())))
        )
    except (OSError, ValueError) as e:
        raise WorkdirError(
            f"{path} cannot be read ({one_line(e)}); restore it or use a new --workdir"
        ) from None
    now = experiment.flat_keys(
        json.loads(experiment.to_json(cfg))
    )  # as JSON holds them (tuples are lists)
    return [
        f"{k}: {saved.get(k)!r} -> {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k) and not k.startswith(FREE_ON_RESUME)
    ]


def check_config(workdir: pathlib.Path, cfg, allow_changes: bool = False) -> list[str]:
    """The changed values of a resumed run; refuses model/data changes, and others unless
    ``allow_changes``."""
    changes = config_changes(pathlib.Path(workdir), cfg)
    saved_path = pathlib.Path(workdir) / CONFIG_FILE
    # the model, the data, and what the state holds (LoRA's adapters, of a rank, where)
    fixed = [c for c in changes if c.startswith(("model.", "data.", "lora.rank", "lora.targets"))]
    if fixed:
        raise experiment.ExperimentError(
            f"{workdir} holds a run with a different model/data/LoRA config (differs in "
            f"{[c.split(':')[0] for c in fixed]}); use a new --workdir, or repeat the run with "
            f"--config {saved_path}"
        )
    if changes and not allow_changes:
        steps = any(c.startswith("train.steps:") for c in changes)
        extend = "--extend to train on to the new train.steps with the schedule's shape kept, "
        raise experiment.ExperimentError(
            f"{workdir} holds a run with other values ({'; '.join(changes)}); pass "
            "--allow-changes to resume with them (applied from the resumed step on, the "
            "learning-rate schedule included: rebuilt for the new train.steps), "
            f"{extend if steps else ''}repeat the run with --config {saved_path}, or use a "
            "new --workdir"
        )
    return changes


class Lock:
    """An exclusive ``fcntl`` lock on ``DIR/lock`` holding the owner's pid and host."""

    def __init__(self, workdir: pathlib.Path):
        self.path = workdir / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise WorkdirError(
                f"{workdir} is in use by another attnlab process ({owner}); wait for it to "
                "finish, or choose another --workdir"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def release(self):
        """Removes the file (still holding the lock) and closes it, which drops the lock."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def _host() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


class Run:
    """One run's work directory: its config, task, checkpoints, logs and where it stands.

    The constructor checks and writes nothing; ``begin`` locks the directory and writes.
    ``step`` picks the checkpoint to resume from (default: the newest readable one).
    """

    def __init__(self, cfg, workdir, mcfg: ModelConfig, *, step=None, allow_changes=False):
        self.cfg, self.workdir = cfg, pathlib.Path(workdir)
        check_workdir(self.workdir)
        self.changes = check_config(self.workdir, cfg, allow_changes)
        tokenizer_saved = (self.workdir / TOKENIZER_FILE).is_file()
        # a new surgery run reads its source's tokenizer (``begin`` saves it here)
        tokenizer_dir = self.workdir if tokenizer_saved else surgery.tokenizer_dir(cfg)
        self.task = make_task(cfg.data, tokenizer_dir, host=_host())
        vocab = self.task.vocab_size
        if vocab > mcfg.vocab_size:
            raise experiment.ExperimentError(
                f"model.vocab_size={mcfg.vocab_size} is smaller than the data's vocabulary "
                f"({vocab} ids); set --config.model.vocab_size={vocab}"
            )
        self.requested = step
        self.ckpt: Checkpointer | None = None
        self.lock: Lock | None = None
        self.start: int | None = None
        self.elapsed, self.step = 0.0, 0
        self.record: dict | None = None  # the record logged at the last step, if any
        self.failure: Exception | None = None
        self.eval_batches: list | None = None  # built by preflight, used by the loop
        # For ``close(discard=True)``: the folders ``begin`` made (outermost first, the
        # work directory last), else the names the work directory held before it.
        self.made: list[pathlib.Path] = []
        self.held: set[str] = set()
        self.saved_config: bytes | None = None  # config.json as begin found it
        self.layout: str | None = None  # where it trains (``sharding.layout``), once known
        self.base_saved = False  # a LoRA run's frozen parameters are in DIR/lora_base

    def begin(self):
        """Locks the directory and writes the config and tokenizer: the run starts."""
        self.made = [p for p in (self.workdir, *self.workdir.parents) if not p.exists()][::-1]
        self.held = set() if self.made else set(os.listdir(self.workdir))
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            # The processes of one multi-host run share the directory: process 0 holds it.
            self.lock = Lock(self.workdir) if is_writer() else None
            check_config(self.workdir, self.cfg, allow_changes=bool(self.changes))
            keep = int(self.cfg.checkpoint.max_to_keep)
            self.ckpt = Checkpointer(self.workdir / CHECKPOINTS, max_to_keep=keep)
            self.ckpt.check_writable()  # now, not at the first save many steps later
            if is_writer():
                saved = self.workdir / CONFIG_FILE
                self.saved_config = saved.read_bytes() if saved.is_file() else None
                text = experiment.to_json(self.cfg)
                if self.saved_config != text.encode():  # a resume as saved leaves it be
                    atomic_write(saved, text)
                tokenizer = self.task.tokenizer
                if tokenizer is not None and not (self.workdir / TOKENIZER_FILE).exists():
                    tokenizer.save(self.workdir / TOKENIZER_FILE)
        except OSError as e:
            self.close(discard=True)
            raise WorkdirError(
                f"cannot write to {self.workdir} ({e.strerror or one_line(e)}); choose a "
                "writable --workdir"
            ) from None
        except BaseException:
            self.close(discard=True)
            raise
        steps = self.ckpt.all_steps()
        if self.requested is not None and int(self.requested) not in steps:
            self.close(discard=True)
            raise CheckpointError(
                f"--step {self.requested}: {self.workdir / CHECKPOINTS} has no such checkpoint "
                f"(available steps: {steps})"
            )

    def close(self, *, discard: bool = False):
        """Ends the run's hold on its directory; with ``discard`` (a run that did not
        start), first removes what ``begin`` created there."""
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
        if discard:
            self._discard()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _discard(self):
        """The work directory as it was before ``begin``: the folders it made removed (the
        work directory whole, those above it when empty), else the new entries in it.
        Only while holding the lock, so another process's files are never touched."""
        if not is_writer():
            return
        if self.lock is not None and self.made:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.lock is not None and self.workdir.is_dir():
            for name in set(os.listdir(self.workdir)) - self.held - {LOCK_FILE}:
                path = self.workdir / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            config = self.workdir / CONFIG_FILE
            if self.saved_config is not None and config.read_bytes() != self.saved_config:
                config.write_bytes(self.saved_config)  # a resume's changed values, undone
        for folder in reversed(self.made):  # the parents begin made, when left empty
            with contextlib.suppress(OSError):
                folder.rmdir()

    def initial_state(self, trainer, abstract):
        """A fresh train state, or the chosen checkpoint's (dropping later log records)."""
        steps = self.ckpt.all_steps()
        if self.requested is not None:
            steps = [int(self.requested)]
        else:  # a save the last process died in is undone, not an error
            steps = set_aside_unfinished(self.ckpt, steps)
        self.layout = sharding.layout(trainer.mesh)
        if not steps:
            self.start = 0
            if surgery.active(self.cfg):  # the source's parameters, with the surgery applied
                return surgery.initial_state(self.cfg, trainer)
            return trainer.init_state()
        state, self.start = restore_newest(
            self.ckpt, abstract, steps, trainer.all_finite, move_aside=True,
            empty_acc=trainer.empty_acc(),
        )  # fmt: skip
        self.base_saved = True  # (a LoRA run's, restored from there)
        if self.requested is not None:  # the newer steps this run will write again
            set_aside_corrupt(self.ckpt, self.start)
        metadata = self.ckpt.restore_metadata(self.start)
        self.elapsed = float(metadata.get("elapsed_sec", 0.0))
        host = _host()
        # The input pipeline's position, where it has one: the same on every process.
        self.task.restore_data_state(metadata.get("data_state"))
        if self.changes:
            set_optim_values(state["opt_state"], self.cfg.optim)
        truncate_jsonl(self.workdir / METRICS_FILE, self.start)
        truncate_jsonl(self.workdir / SAMPLES_FILE, self.start)
        if self.start >= int(self.cfg.train.steps):
            print(
                f"already finished: {self.workdir} holds step {self.start} of "
                f"{int(self.cfg.train.steps)}; raise train.steps to train on (with --extend, the "
                "learning-rate schedule carries on instead of being rebuilt)",
                flush=True,
            )
        else:
            print(f"resuming from step {self.start} in {self.workdir}", flush=True)
        saved = metadata.get("layout")
        if saved and saved != self.layout and host[0] == 0:
            print(f"resuming on {self.layout} (saved on {saved})", flush=True)
        return state

    def save(self, step, state):
        """Writes ``state`` as ``step``, replacing an older checkpoint of the same step; the
        metadata records the signal (``interrupted``) that stopped the run there, if any."""
        if step in self.ckpt.all_steps():
            self.ckpt.delete(step)
        meta = {"elapsed_sec": self.elapsed, "step": step, "interrupted": stop_signal()}
        meta["layout"] = self.layout
        # The input pipeline's position, the same on every process (the global batch's).
        meta["data_state"] = self.task.data_state()
        if "lora" in state:  # the frozen parameters once, the adapters alone beside
            if not self.base_saved:
                save_base(self.workdir, state["params"])
                self.base_saved = True
            if is_writer():
                lora.save(
                    self.workdir / LORA_ADAPTERS, lora.spec_from(self.cfg.lora), state["lora"]
                )
        self.ckpt.save(step, saved_part(state), metadata=meta, force=True)

    def log(self, record: dict, file: str = METRICS_FILE):
        append_jsonl(self.workdir / file, record)
