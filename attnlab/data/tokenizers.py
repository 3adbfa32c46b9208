"""Character and byte tokenizers, and the id check every batch passes before it reaches a model.

Both tokenizers share one API: ``vocab_size``, ``encode(str) -> int32 [n]``,
``decode(ids) -> str`` and ``save(path)`` (JSON with a ``"kind"`` field);
``load_tokenizer(path)`` reads either kind back, and a Hugging Face ``tokenizer.json``
(``attnlab.data.bpe``) too.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np

TOKENIZER_KINDS = ("char", "byte", "bpe")


def validate_ids(ids, vocab_size, name="input ids"):
    """Return ``ids`` as an array after checking every id lies in ``[0, vocab_size)``.

    JAX gathers clamp out-of-range indices silently, so ids are checked on the host, by the
    one check generation uses too (``attnlab.decode.checks.check_ids``).
    """
    from attnlab.decode.checks import check_ids  # imported on use: data stays NumPy-only

    return check_ids(ids, vocab_size, name)


def _as_id_vector(ids, vocab_size):
    arr = np.atleast_1d(validate_ids(ids, vocab_size, name="ids to decode"))
    if arr.ndim != 1:
        raise ValueError(f"decode takes one sequence of ids, got shape {arr.shape}")
    return arr


def _write_json(path, payload):
    """Write JSON through a temporary file so a reader never sees half a file."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class CharTokenizer:
    """One id per distinct character; ids follow the order of ``chars``."""

    kind = "char"

    def __init__(self, chars: str | Sequence[str]):
        chars = list(chars)
        if any(len(c) != 1 for c in chars):
            raise ValueError("CharTokenizer: every vocabulary entry must be a single character")
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: the vocabulary has repeated characters")
        if not chars:
            raise ValueError("CharTokenizer: the vocabulary is empty")
        self.chars = "".join(chars)
        self._codes = np.array([ord(c) for c in chars], np.uint32)
        self._lookup = np.full(int(self._codes.max()) + 1, -1, np.int32)  # code point -> id
        self._lookup[self._codes] = np.arange(len(chars), dtype=np.int32)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary = the sorted distinct characters of ``text``."""
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), "<u4")
        ids = self._lookup[np.minimum(codes, len(self._lookup) - 1)]
        unknown = (codes >= len(self._lookup)) | (ids < 0)
        if unknown.any():
            i = int(np.argmax(unknown))
            raise ValueError(
                f"character {text[i]!r} (U+{ord(text[i]):04X}) at index {i} is not in the "
                f"{self.vocab_size}-character vocabulary, which was built from the training "
                "corpus; use the byte tokenizer (data.tokenizer='byte') for open-ended text"
            )
        return ids

    def decode(self, ids) -> str:
        codes = self._codes[_as_id_vector(ids, self.vocab_size)]
        return codes.astype("<u4").tobytes().decode("utf-32-le")

    def save(self, path) -> None:
        _write_json(path, {"kind": self.kind, "chars": self.chars})

    def __eq__(self, other):
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __hash__(self):
        return hash((self.kind, self.chars))

    def __repr__(self):
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class ByteTokenizer:
    """UTF-8 bytes as ids (256 of them); decoding replaces invalid byte sequences."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        data = _as_id_vector(ids, self.vocab_size).astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def save(self, path) -> None:
        _write_json(path, {"kind": self.kind})

    def __eq__(self, other):
        return isinstance(other, ByteTokenizer)

    def __hash__(self):
        return hash(self.kind)

    def __repr__(self):
        return "ByteTokenizer()"


def load_tokenizer(path):
    """Read a tokenizer written by ``save``, whichever its kind, or a Hugging Face one.

    A missing file is a ``DataFileError``; one that is not JSON, has an unknown kind or a
    model the ``tokenizers`` library rejects is a ``TokenizerError`` naming the file.
    """
    from attnlab.errors import DataFileError, TokenizerError

    path = pathlib.Path(path)
    if not path.is_file():
        raise DataFileError(
            f"no tokenizer file {str(path)!r}; set data.tokenizer to 'char', 'byte', 'bpe' or "
            "the path of a tokenizer.json"
        )
    fix = "restore it, or delete it to have it rebuilt from the data (a new --workdir for a run)"
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TokenizerError(f"tokenizer {path} is not readable JSON ({e}); {fix}") from None
    if not isinstance(payload, dict):
        raise TokenizerError(f"tokenizer {path} holds no JSON object; {fix}")
    kind = payload.get("kind")
    try:
        if kind is None and "model" in payload:  # the tokenizers library's own format
            from attnlab.data.bpe import HFTokenizer

            return HFTokenizer.from_file(path)
        if kind == "char":
            return CharTokenizer(payload["chars"])
        if kind == "byte":
            return ByteTokenizer()
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise TokenizerError(
            f"tokenizer {path} is broken ({' '.join(str(e).split()) or type(e).__name__}); {fix}"
        ) from None
    raise TokenizerError(
        f"tokenizer {path}: unknown tokenizer kind {kind!r}; expected one of {TOKENIZER_KINDS}"
        " or a Hugging Face tokenizer.json"
    )
