"""The exception family of expected errors: each message names the file, field or token and
the fix, in the terms of the ``attnlab`` command (``--config.a.b=...``, ``--step N``).

``attnlab`` prints such an error as one line on stderr and exits with its ``exit_code``: 2 for
what the user asked for (config, data, work directory, decoding, pretrained inputs), 1 for
failures found while running (a diverging run, an unreadable checkpoint, a full disk), 130 or
143 for a run stopped by SIGINT or SIGTERM once its checkpoint was written. Anything else is a
bug and keeps its traceback. Subclasses keep the built-in bases callers already catch
(``ValueError`` for invalid values, ``FileNotFoundError`` for absent files, ``RuntimeError``
for run-time failures), so the Python API raises the same types the command reports.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import signal
import threading


class AttnlabError(Exception):
    """An expected error; ``str(e)`` is the whole message, ``exit_code`` the CLI's status."""

    exit_code = 2
    label = "error"  # the word after ``attnlab COMMAND:`` in the line the CLI prints


class ConfigError(AttnlabError, ValueError):
    """An experiment config or override that cannot run."""


class DataError(AttnlabError, ValueError):
    """A data file, tokenizer or text that cannot feed the run."""


class DataFileError(DataError, FileNotFoundError):
    """A data file that does not exist."""


class PreparedCorpusError(DataError):
    """A prepared corpus directory whose token file or metadata is missing, cut short or
    written for another tokenizer."""


class TokenizerError(DataError):
    """A tokenizer file that cannot be read (not JSON, an unknown kind, a broken model)."""


class TokenIdError(DataError):
    """A batch holding an id outside the vocabulary (it would give a NaN loss, not an error)."""


class FetchError(DataError, OSError):
    """A download that could not be made (offline, refused, not found); nothing was kept."""


class MissingPackageError(AttnlabError, ImportError):
    """An optional package that what was asked for needs is not installed: the message names
    the extra that brings it."""


class DecodeError(AttnlabError, ValueError):
    """Token ids, sampling values or lengths that generation cannot take."""


class InspectError(AttnlabError, ValueError):
    """An intermediate name, capture or patch that a forward pass cannot take (an unknown
    name, a patch of the wrong shape, a capture larger than allowed)."""


class PretrainedError(AttnlabError):
    """A Hugging Face checkpoint that cannot be loaded."""


class PretrainedFileError(PretrainedError, FileNotFoundError):
    """A Hugging Face checkpoint folder without a file it needs, or with one that is unreadable."""


class WorkdirError(AttnlabError, RuntimeError):
    """A work directory that cannot hold this run (in use, not a directory, not writable)."""


class CheckpointError(AttnlabError, RuntimeError):
    """A checkpoint that is missing, unreadable, or does not match the run."""

    exit_code = 1


class DiskFullError(CheckpointError, OSError):
    """A checkpoint that could not be written for want of space; the older ones are kept."""


class DivergenceError(AttnlabError, FloatingPointError):
    """Training produced a non-finite loss, gradient norm or parameters."""

    exit_code = 1


class Interrupted(AttnlabError):
    """A run stopped by a signal after writing its checkpoint: it resumes with the same
    command. ``exit_code`` is the shell's for that signal (128 + its number: SIGINT 130,
    SIGTERM 143)."""

    label = "stopped"

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal_name = signal_name
        self.exit_code = 128 + int(signal.Signals[signal_name])


def _missing(module: str, extra: str | None, what: str) -> MissingPackageError:
    target = "." if extra is None else f'".[{extra}]"'  # None: a core dependency
    return MissingPackageError(
        f"{what} needs the {module} package, which is not installed: run "
        f"pip install -e {target} in the attnlab folder"
    )


def require(module: str, extra: str | None, what: str) -> None:
    """Refuses ``what`` (the config value or flag that asked for it) unless the optional
    ``module`` is installed (found, not imported); the message names the ``extra`` of
    pyproject.toml that brings it (None: a core dependency, brought by ``pip install -e .``)."""
    if importlib.util.find_spec(module) is None:
        raise _missing(module, extra, what)


def optional_import(module: str, extra: str | None, what: str):
    """``import module`` for ``what``, a ``MissingPackageError`` naming the extra when it is
    not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but one of its own imports failed: a real error
        raise _missing(module, extra, what) from None


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line."""
    return " ".join(str(error).split())


# Checks of traced values (under jit a value cannot raise). They are made only while a step
# is traced inside ``attnlab.decode.checks.checked_jit``, as ``checkify`` checks that raise
# after the call; anywhere else they add nothing to the program (no operation, no effect: a
# jitted call keeps its fast dispatch).
_TRACED = threading.local()


def checking_traced() -> bool:
    """Whether the function being traced runs under ``checked_jit``."""
    return getattr(_TRACED, "on", False)


@contextlib.contextmanager
def traced_checks():
    """Makes ``traced_check`` bind its checks while the block traces (``checked_jit``)."""
    before = checking_traced()
    _TRACED.on = True
    try:
        yield
    finally:
        _TRACED.on = before


def traced_check(ok, message: str, **values) -> None:
    """Under ``traced_checks``: a ``checkify`` check that ``ok()`` holds, its failure
    reported as ``message`` formatted with ``values()`` (traced; ``{name}`` placeholders).
    Elsewhere nothing: ``ok`` and ``values`` are callables, so no operation is traced."""
    if not checking_traced():
        return
    from jax.experimental import checkify

    checkify.check(ok(), message, **{k: v() for k, v in values.items()})
