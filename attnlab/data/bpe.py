"""Subword tokenizers from the Hugging Face ``tokenizers`` library.

``train_bpe(text, vocab_size)`` trains a byte-level BPE (GPT-2's pre-tokenizer and decoder, so
every string round-trips); ``HFTokenizer.from_file`` reads any ``tokenizer.json``. Both give
the char/byte API: ``vocab_size``, ``encode(str) -> int32 [n]``, ``decode(ids) -> str``,
``save(path)`` (the library's own ``tokenizer.json``).
"""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the attnlab tokenizer API."""

    kind = "bpe"

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_file(cls, path) -> HFTokenizer:
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"data.tokenizer: no such tokenizer file {str(path)!r}")
        return cls(Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts) -> list[np.ndarray]:
        """Many texts at once, in parallel threads inside the library."""
        out = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in out]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = np.atleast_1d(np.asarray(ids)).astype(np.int64).tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def save(self, path) -> None:
        path = pathlib.Path(path)
        tmp = path.with_name(path.name + ".tmp")
        self.tokenizer.save(str(tmp))
        tmp.replace(path)

    def fingerprint(self) -> str:
        """SHA-256 of the serialised tokenizer (names it in prepared-corpus metadata)."""
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    def __eq__(self, other):
        return isinstance(other, HFTokenizer) and other.fingerprint() == self.fingerprint()

    def __hash__(self):
        return hash(self.fingerprint())

    def __repr__(self):
        return f"HFTokenizer(vocab_size={self.vocab_size})"


def train_bpe(texts, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE with at most ``vocab_size`` ids trained on ``texts`` (str or list)."""
    if vocab_size < 257:
        raise ValueError(f"data.vocab_size={vocab_size}: a byte-level BPE needs at least 257 ids")
    texts = [texts] if isinstance(texts, str) else list(texts)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Lines keep the trainer's memory and threads busy evenly; the result does not depend on it.
    tok.train_from_iterator((line for t in texts for line in t.splitlines(keepends=True)), trainer)
    return HFTokenizer(tok)
