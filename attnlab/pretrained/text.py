"""Text in, text out for a loaded checkpoint whose folder holds a ``tokenizer.json``.

Prompts are encoded by the Hugging Face ``tokenizers`` library with the checkpoint's own
special tokens (as ``AutoTokenizer(prompt)`` would), right-padded into one batch, generated
with ``Pretrained.generate`` and the new ids decoded (special tokens skipped by default).
"""

from __future__ import annotations

import os

import numpy as np

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_of(handle):
    """The ``tokenizers.Tokenizer`` of the checkpoint folder (read once per handle)."""
    cached = getattr(handle, "_tokenizer", None)
    if cached is None:
        from tokenizers import Tokenizer

        from attnlab.errors import PretrainedFileError, one_line

        path = os.path.join(handle.path or "", TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise PretrainedFileError(
                f"{handle.path} has no {TOKENIZER_FILE}: text generation needs the checkpoint's "
                "tokenizer; download it into the folder (or use generate() with token ids)"
            )
        try:
            cached = handle._tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise PretrainedFileError(
                f"{path} is not a readable tokenizer ({one_line(e)}); download it again"
            ) from None
    return cached


def generate_text(
    handle, prompts, max_new_tokens: int = 32, *, skip_special_tokens: bool = True, **options
):
    """The continuation of each prompt as a string (a list for a list of prompts)."""
    tok = tokenizer_of(handle)
    single = isinstance(prompts, str)
    texts = [prompts] if single else list(prompts)
    if not texts:
        raise ValueError("generate_text needs at least one prompt")
    rows = [e.ids for e in tok.encode_batch(texts)]
    if any(not r for r in rows):
        raise ValueError("a prompt encodes to no tokens; give each prompt some text")
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), handle.pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
    result = handle.generate(
        ids, max_new_tokens, attention_mask=None if mask.all() else mask, **options
    )
    out = [
        tok.decode(
            result.tokens[b, : result.lengths[b]].tolist(),
            skip_special_tokens=skip_special_tokens,
        )
        for b in range(len(rows))
    ]
    return out[0] if single else out
