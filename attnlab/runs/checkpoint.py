"""Save, restore and resume training state with orbax.

A run's ``workdir`` holds one directory per saved step::

    <workdir>/<step>/state/      the state pytree (orbax StandardSave, OCDBT + zarr)
    <workdir>/<step>/metadata/   a small JSON dict saved beside it (e.g. the config)

``Checkpointer`` wraps ``orbax.checkpoint.CheckpointManager``; it serialises nothing itself.

Atomicity. On a local filesystem orbax writes step ``N`` into ``<workdir>/N.orbax-checkpoint-tmp``
(orbax 0.12.8 puts no timestamp in that name), writes ``commit_success.txt`` into it, and only
then renames it to ``<workdir>/N``. Directories with the ``-tmp`` suffix are
never listed as steps, so a save killed half way leaves a directory that ``latest_step`` ignores
and ``restore`` never reads; the next save of that step removes it and starts afresh. ``save``
waits for orbax to finish (``wait_until_finished``), so once it returns the step is final.

Integrity. Once orbax has finalised step ``N``, ``save`` writes ``<workdir>/N/checksums.json``
(through a temporary file and a rename): the size and CRC-32 (``attnlab.data.checksums``) of every
file of the step's two items: the arrays' data files, orbax's tree metadata and manifests, and
the JSON metadata (orbax's own records beside them, ``_CHECKPOINT_METADATA`` and
``commit_success.txt``, hold no values and are not covered). The metadata records that the step
has checksums, so a step finalised without its ``checksums.json`` (the process died in
between) is never taken for one written before checksums existed; a resumed run moves such
newest steps aside (``files.set_aside_unfinished``) and continues from the last finished one.
Restoring a step first reads every file and compares; a file that differs, is missing or
was resized raises ``CorruptCheckpointError`` naming it, so no flipped bit reaches a restored
state. Steps written before checksums existed (no record in their metadata) are restored
unverified. ``verify`` runs the same checks without restoring.

Errors. Restoring checks the stored tree (paths, shapes, dtypes, read from orbax's metadata)
against the target first (``attnlab.runs.checkpoint_match``). A mismatch, a missing step or
an unreadable (truncated, garbled, incomplete) checkpoint raises ``CorruptCheckpointError``
naming the directory and step; nothing on disk is deleted or rewritten by a failed restore.
A run that falls back to an older step moves the unreadable one aside (``move_aside``:
``<workdir>/step_N.corrupt/``, which is never listed as a step), so a later save of step
``N`` cannot replace it and it stays there for inspection. A save that fails for want of
space (``ENOSPC``, ``EDQUOT``) is a ``DiskFullError`` naming the newest step that is still
on disk.

Preemption. ``PreemptionGuard``, ``stop_signal`` and ``raise_if_stopped`` live in
``attnlab.runs.preemption`` and are read from here too.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from attnlab.data.checksums import CHECKSUMS, file_checksum
from attnlab.errors import (
    CheckpointError,
    ConfigError,
    DiskFullError,
    WorkdirError,
    one_line,
)
from attnlab.runs.checkpoint_match import (  # noqa: F401  (also read from here)
    _abstract_leaf,
    _check_matches,
)
from attnlab.runs.preemption import (  # noqa: F401  (also read from here)
    _RECEIVED,
    PreemptionGuard,
    raise_if_stopped,
    stop_signal,
)

_STATE = "state"
_METADATA = "metadata"
CHECKSUM_FILE = "checksums.json"
_CHECKSUMMED = "_checksums"  # the key in a step's metadata that says it has CHECKSUM_FILE


__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "PreemptionGuard",
    "UnfinishedCheckpointError",
    "stop_signal",
]
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CorruptCheckpointError(CheckpointError):
    """A finalised checkpoint that cannot be read (older steps may still be good);
    ``reason`` is the library's own first line, cut short."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class UnfinishedCheckpointError(CorruptCheckpointError):
    """A step orbax finalised whose own save did not finish: the process died before the
    step's checksums were written, so its files were never vouched for."""


class Checkpointer:
    """Keeps the last ``max_to_keep`` checkpoints of a training state pytree in ``directory``.

    ``checksum`` names the checksum (a key of ``CHECKSUMS``) written with each step, or None
    to write none (restoring verifies whatever a step recorded either way).
    """

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        max_to_keep: int = 3,
        checksum: str | None = "crc32",
    ):
        if checksum is not None and checksum not in CHECKSUMS:
            raise ConfigError(f"checksum={checksum!r} is not one of {sorted(CHECKSUMS)}")
        self.checksum = checksum
        self._verified: set[int] = set()
        if max_to_keep < 1:
            raise ConfigError(
                f"checkpoint.max_to_keep={max_to_keep} must be at least 1; "
                "set --config.checkpoint.max_to_keep=1 or more"
            )
        self.directory = pathlib.Path(directory).absolute()
        for where in (self.directory, *self.directory.parents):
            if where.exists() and not where.is_dir():
                raise WorkdirError(
                    f"{where} is a file where the checkpoint directory {self.directory} needs a "
                    "directory; move the file away or choose another --workdir"
                )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                create=True,
                async_options=_directories_at_once(),
            ),
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _METADATA: ocp.JsonCheckpointHandler(),
            },
        )

    def save(
        self,
        step: int,
        state: Any,
        *,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Writes ``state`` (and ``metadata``) as ``step``; returns whether anything was written.

        A step that already exists is never overwritten. Without ``force``, a step at or below
        the latest one is skipped as well; ``force`` writes it anyway (e.g. after resuming
        from an older step). Retention then drops the earliest-written steps.
        """
        step = int(step)
        if step in self._manager.all_steps():
            return False
        metadata = dict(metadata or {})
        if self.checksum is not None:
            metadata[_CHECKSUMMED] = self.checksum
        args = ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(state), _METADATA: ocp.args.JsonSave(metadata)}
        )
        self._verified.discard(step)
        try:
            saved = self._manager.save(step, args=args, force=force)
            self._manager.wait_until_finished()
            if saved and self.checksum is not None and jax.process_index() == 0:
                self._write_checksums(step)
        except Exception as e:
            self._discard_partial(step)
            if step in self._manager.all_steps():  # finalised, but its checksums are not
                self._manager.delete(step)
            kept = self.latest_step()
            kept = f"step {kept} is kept" if kept is not None else "no earlier step was written"
            if _caused_by_no_space(e):
                raise DiskFullError(
                    f"cannot write checkpoint step {step} in {self.directory}: no space left on "
                    f"the device; {kept}. Free some space (or lower "
                    "--config.checkpoint.max_to_keep) and run the same command to resume"
                ) from e
            if isinstance(e, OSError):
                raise WorkdirError(
                    f"cannot write checkpoint step {step} in {self.directory} "
                    f"({e.strerror or one_line(e)}); {kept}. Fix the directory and run the "
                    "same command to resume"
                ) from e
            raise
        return bool(saved)

    def _write_checksums(self, step: int) -> None:
        """Writes ``N/checksums.json``: each file of the step's items, its size and checksum."""
        folder = self.directory / str(step)
        files = {}
        for item in (_STATE, _METADATA):
            for path in sorted((folder / item).rglob("*")):
                if path.is_file():
                    name = path.relative_to(folder).as_posix()
                    files[name] = [path.stat().st_size, file_checksum(path, self.checksum)]
        record = {"algorithm": self.checksum, "files": files}
        tmp = folder / (CHECKSUM_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=0)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / CHECKSUM_FILE)

    def verify(self, step: int | None = None) -> None:
        """Checks ``step`` (default: the latest) without restoring it: each file against the
        checksum written with it, and orbax's tree metadata; raises ``CorruptCheckpointError``
        naming the first file that fails. A step saved before checksums existed is only
        checked for readable metadata."""
        step = self._resolve(step)
        self._check_files(step)
        try:
            self._manager.metadata(step).item_metadata[_STATE]
        except Exception as e:
            raise self._corrupt(step, f"the tree metadata cannot be read ({_short(e)})") from e

    def _corrupt(self, step: int, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self._where(step)} is corrupt: {problem}{self._hint(step)}", _short(problem, 160)
        )

    def _check_files(self, step: int) -> None:
        """Compares each file of ``step`` with ``checksums.json`` (once per step and
        ``Checkpointer``); a step whose metadata says it has none is not checked."""
        if step in self._verified:
            return
        folder = self.directory / str(step)
        record = folder / CHECKSUM_FILE
        if record.exists():
            try:
                recorded = json.loads(record.read_text())
                check, files = CHECKSUMS[recorded["algorithm"]], recorded["files"]
                files = {
                    str(name): (int(size), str(digest)) for name, (size, digest) in files.items()
                }
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                problem = f"{CHECKSUM_FILE} cannot be read ({_short(e, 80)})"
                raise self._corrupt(step, problem) from None
            for name, (size, digest) in files.items():
                path = folder / name
                if not path.is_file():
                    raise self._corrupt(step, f"{name} is missing")
                if path.stat().st_size != size:
                    problem = f"{name} has {path.stat().st_size} bytes where {size} were written"
                    raise self._corrupt(step, problem)
                with open(path, "rb") as file:
                    if check(file) != digest:
                        problem = (
                            f"{name} does not match the {recorded['algorithm']} checksum "
                            "written with it"
                        )
                        raise self._corrupt(step, problem)
        elif self.unfinished(step):
            problem = f"{CHECKSUM_FILE} is missing (the save did not finish)"
            where = f"{self._where(step)} is corrupt: {problem}{self._hint(step)}"
            raise UnfinishedCheckpointError(where, problem)
        self._verified.add(step)

    def unfinished(self, step: int) -> bool:
        """Whether ``step``'s save died between orbax finalising it and its checksums being
        written (its metadata promises a ``checksums.json`` that is not there)."""
        if (self.directory / str(step) / CHECKSUM_FILE).exists():
            return False
        return _CHECKSUMMED in self._read_metadata(step)

    def _discard_partial(self, step: int) -> None:
        """Removes what a failed save of ``step`` left, as far as orbax's writes still in
        flight allow; the rest is a ``-tmp`` directory, never read, that the next save of
        ``step`` replaces."""
        for tmp in self.directory.glob(f"{int(step)}.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def move_aside(self, step: int) -> pathlib.Path:
        """Renames the unreadable ``step`` to ``step_N.corrupt/`` (``.2``, ``.3``... when
        taken) and returns the new path; it is no longer a step, so nothing replaces it."""
        source = self.directory / str(int(step))
        target = self.directory / f"step_{int(step)}.corrupt"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"step_{int(step)}.corrupt.{n}"
        source.rename(target)
        self._verified.discard(int(step))
        self._manager.reload()
        return target

    def delete(self, step: int) -> None:
        """Removes ``step`` (a save of the same step replaces it this way)."""
        self._verified.discard(int(step))
        self._manager.delete(int(step))

    def latest_step(self) -> int | None:
        """The newest finalised step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All finalised steps, oldest first."""
        return sorted(self._manager.all_steps())

    def stored_tree(self, step: int | None = None) -> Any:
        """The tree of the state saved as ``step``, each leaf's metadata (``.shape``,
        ``.dtype``) where its array lies."""
        step = self._resolve(step)
        try:
            return self._manager.metadata(step).item_metadata[_STATE].tree
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot read the tree metadata of {self._where(step)}: {_short(e)}"
                f"{self._hint(step)}",
                _short(e, 120),
            ) from e

    def restore(self, target: Any, step: int | None = None) -> Any:
        """Restores ``step`` (default: the latest) into the structure of ``target``.

        ``target`` is a pytree whose leaves are arrays or ``jax.ShapeDtypeStruct``; leaves
        come back as ``jax.Array`` on the target's sharding, or on the default device.
        """
        step = self._resolve(step)
        where = self._where(step)
        self._check_files(step)
        try:
            stored = self._manager.metadata(step).item_metadata[_STATE]
            stored = ocp.tree.to_flat_dict(stored.tree)
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot read the tree metadata of {where}: {_short(e)}{self._hint(step)}",
                _short(e, 120),
            ) from e
        abstract = jax.tree.map(_abstract_leaf, target)
        _check_matches(stored, ocp.tree.to_flat_dict(abstract), where)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
            )
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot restore {where}: {_short(e)}{self._hint(step)}", _short(e, 120)
            ) from e
        return restored[_STATE]

    def restore_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON dict saved with ``step`` (default: the latest)."""
        step = self._resolve(step)
        self._check_files(step)
        metadata = self._read_metadata(step)
        metadata.pop(_CHECKSUMMED, None)
        return metadata

    def _read_metadata(self, step: int) -> dict[str, Any]:
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()})
            )
        except Exception as e:
            raise CorruptCheckpointError(
                f"cannot read the metadata of {self._where(step)}: {_short(e)}{self._hint(step)}",
                _short(e, 120),
            ) from e
        return dict(restored[_METADATA] or {})

    def check_writable(self) -> None:
        """Raises ``WorkdirError`` unless a file can be created in the directory (a run
        checks this before its first step rather than failing at its first save)."""
        try:
            fd, name = tempfile.mkstemp(prefix=".write-check-", dir=self.directory)
            os.close(fd)
            os.unlink(name)
        except OSError as e:
            raise WorkdirError(
                f"cannot write checkpoints to {self.directory} ({e.strerror or one_line(e)}); "
                "make it writable or choose another --workdir"
            ) from None

    def close(self) -> None:
        """Waits for outstanding work and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _where(self, step: int) -> str:
        return f"checkpoint step {step} in {self.directory}"

    def _hint(self, step: int) -> str:
        older = [s for s in self.all_steps() if s < step]
        return (
            f". The directory was left as it is; --step N reads an older step (available: {older})."
            if older
            else ". The directory was left as it is; train again in a new --workdir."
        )

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no finalised checkpoint in {self.directory}")
            return steps[-1]
        if int(step) not in steps:
            raise CheckpointError(
                f"no finalised checkpoint for step {step} in {self.directory} "
                f"(available steps: {steps}); pass --step with one of them"
            )
        return int(step)


def _directories_at_once() -> ocp.AsyncOptions | None:
    """Orbax's options that create a step's directory before the save returns: one that cannot
    be created then fails the save at once, where made in the background its failure left
    orbax's writer threads waiting 300 s for it. None (the default) for an orbax that has no
    such option, as it created directories at once."""
    try:
        return ocp.AsyncOptions(create_directories_asynchronously=False)
    except TypeError:
        return None


def _caused_by_no_space(error: BaseException | None) -> bool:
    """Whether ``error`` or an exception it was raised from is a full disk or quota."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) in _NO_SPACE or "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _short(error: BaseException, limit: int = 300) -> str:
    """The first line of a library's error message, cut to ``limit`` characters."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."
