"""The exception family of expected errors: each message names the file, field or token and
the fix, in the terms of the ``attnlab`` command (``--config.a.b=...``, ``--step N``).

``attnlab`` prints such an error as one line and exits with its ``exit_code``: 2 for what the
user asked for (config, data, work directory, decoding, pretrained inputs), 1 for failures
found while running (a diverging run, an unreadable checkpoint). Anything else is a bug and
keeps its traceback. Subclasses keep the built-in bases callers already catch (``ValueError``
for invalid values, ``RuntimeError`` for run-time failures).
"""

from __future__ import annotations


class AttnlabError(Exception):
    """An expected error; ``str(e)`` is the whole message, ``exit_code`` the CLI's status."""

    exit_code = 2


class ConfigError(AttnlabError, ValueError):
    """An experiment config or override that cannot run."""


class DataError(AttnlabError, ValueError):
    """A data file, tokenizer or text that cannot feed the run."""


class DataFileError(DataError, FileNotFoundError):
    """A data file that does not exist."""


class DecodeError(AttnlabError, ValueError):
    """Token ids, sampling values or lengths that generation cannot take."""


class PretrainedError(AttnlabError):
    """A Hugging Face checkpoint that cannot be loaded."""


class WorkdirError(AttnlabError, RuntimeError):
    """A work directory that cannot hold this run (in use, not a directory, not writable)."""


class CheckpointError(AttnlabError, RuntimeError):
    """A checkpoint that is missing, unreadable, or does not match the run."""

    exit_code = 1


class DivergenceError(AttnlabError, FloatingPointError):
    """Training produced a non-finite loss, gradient norm or parameters."""

    exit_code = 1


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line."""
    return " ".join(str(error).split())
