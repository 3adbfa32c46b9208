"""Text corpora: a file on disk, or the embedded default built from Python's standard library.

The embedded corpus needs no download and exists wherever Python does: the standard library's
own ``.py`` files, in sorted order of their relative POSIX paths, skipping third-party
packages, test suites, a few large tool packages, machine-specific build files and anything
that is not UTF-8. Its exact content therefore depends on the Python version, not the machine.

``data.path="embedded:documents"`` reads the same text as many short documents
(``stdlib_documents``): cut at every blank line (a docstring, a function, a block of
imports), each piece ended by ``END_OF_DOCUMENT``, so packed rows hold several documents
(``char_lm:tiny_docs``).
"""

from __future__ import annotations

import functools
import os
import pathlib
import sysconfig

import numpy as np

from attnlab.errors import DataError, DataFileError

DEFAULT_MAX_CHARS = 2_000_000

# Directory names skipped anywhere below the standard library root.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_SEPARATOR = "\n\n\n"
EMBEDDED_DOCUMENTS = "embedded:documents"  # the data.path of the embedded corpus as documents
END_OF_DOCUMENT = "\x03"  # ASCII "end of text": the character (and id) ending each document


def load_text(path) -> str:
    """Read a UTF-8 text file, with an error that says what to do when it is missing."""
    path = pathlib.Path(path)
    if not path.is_file():
        from attnlab.data.fetch import DATASETS

        for name, known in DATASETS.items():
            if path.name == known.filename:
                raise DataFileError(
                    f"data.path: no such file {str(path)!r}; `attnlab data fetch {name}` "
                    f"downloads {known.filename}, then use data.path='cache:{name}'"
                )
        raise DataFileError(
            f"data.path: no such file {str(path)!r}; set --config.data.path to a text file, or "
            "leave data.path empty for the embedded corpus (the Python standard library's source)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data.path: {str(path)!r} is not UTF-8 text (byte {e.start}); convert it to UTF-8 "
            "or set --config.data.path to another file"
        ) from None
    except OSError as e:
        raise DataError(f"data.path: cannot read {str(path)!r} ({e.strerror})") from None
    if not text:
        raise DataError(f"data.path: {str(path)!r} is empty; set --config.data.path to a text file")
    return text


def _skipped(rel: pathlib.PurePosixPath) -> bool:
    parts = rel.parts
    if any(p in _SKIP_DIRS or p.startswith("config-") for p in parts[:-1]):
        return True
    return parts[-1].startswith("_sysconfigdata")  # build paths of this machine


def stdlib_source_files() -> list[str]:
    """Relative POSIX paths of the standard library files used by ``stdlib_corpus``, sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                rel = pathlib.PurePosixPath(
                    pathlib.Path(dirpath, name).relative_to(root).as_posix()
                )
                if not _skipped(rel):
                    found.append(rel.as_posix())
    return sorted(found)


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_chars: int | None = DEFAULT_MAX_CHARS) -> str:
    """The embedded corpus: standard library sources joined by blank lines, cut at max_chars."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    pieces, total = [], 0
    for rel in stdlib_source_files():
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        pieces.append(text + _SEPARATOR)
        total += len(pieces[-1])
        if max_chars is not None and total >= max_chars:
            break
    corpus = "".join(pieces)
    if not corpus:
        raise RuntimeError(f"no standard library sources found under {root}")
    return corpus if max_chars is None else corpus[:max_chars]


def stdlib_documents(max_chars: int | None = DEFAULT_MAX_CHARS) -> str:
    """The embedded corpus (``stdlib_corpus``) as short documents: cut at every blank line,
    each non-empty piece followed by ``END_OF_DOCUMENT``, cut at ``max_chars``."""
    pieces = (p.strip("\n") for p in stdlib_corpus(max_chars).split("\n\n"))
    text = "".join(p + END_OF_DOCUMENT for p in pieces if p)
    return text if max_chars is None else text[:max_chars]


def document_ends(ids, end_id: int) -> np.ndarray:
    """The end offset of every document of ``ids``, each ended by ``end_id`` (a last
    document without one ends with the stream)."""
    ends = np.flatnonzero(np.asarray(ids) == end_id) + 1
    return ends if len(ends) and ends[-1] == len(ids) else np.append(ends, len(ids))


def split_train_val(ids, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the first ``1 - val_fraction`` of the stream, then the last part."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    ids = np.asarray(ids)
    n_train = int(len(ids) * (1.0 - val_fraction))
    return ids[:n_train], ids[n_train:]
