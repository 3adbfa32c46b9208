"""Corpora prepared once: text files tokenized into one memory-mapped token file.

``prepare(inputs, out, tokenizer=...)`` writes ``DIR/tokens.bin`` (uint16 ids when the
vocabulary fits, else uint32; the files' tokens one after another), ``DIR/tokenizer.json``
and ``DIR/meta.json`` (tokenizer, counts, the split, a SHA-256 of ``tokens.bin``). The first
``train_tokens`` ids are the training split, the rest validation (the in-memory split of the
same stream). ``data.kind="prepared"`` with ``data.path=DIR`` trains on it: batches index the
memory map, so only the windows a batch needs are read and a corpus larger than RAM works.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
import shutil

import numpy as np

from attnlab.data.corpus import split_train_val
from attnlab.data.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer

TOKENS_FILE, META_FILE, TOKENIZER_FILE = "tokens.bin", "meta.json", "tokenizer.json"
CHUNK_CHARS = 1 << 20


def expand(inputs) -> list[pathlib.Path]:
    """Input files from paths and glob patterns, in order, each once."""
    found: list[pathlib.Path] = []
    for pattern in inputs:
        matches = sorted(glob.glob(str(pattern), recursive=True)) or [str(pattern)]
        for m in matches:
            path = pathlib.Path(m)
            if not path.is_file():
                raise FileNotFoundError(f"data prepare: no such file {m!r}")
            if path not in found:
                found.append(path)
    return found


def _chunks(text: str):
    """Pieces of about ``CHUNK_CHARS`` that end at line ends (pre-tokenizers split there)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _build_tokenizer(spec: str, files, vocab_size: int):
    if spec == "byte":
        return ByteTokenizer()
    if spec == "char":
        return CharTokenizer.from_text("".join(sorted({c for f in files for c in _read(f)})))
    if spec == "bpe":
        from attnlab.data.bpe import train_bpe

        return train_bpe((_read(f) for f in files), vocab_size)
    return load_tokenizer(spec)


def _read(path) -> str:
    return pathlib.Path(path).read_text(encoding="utf-8")


def prepare(
    inputs,
    out,
    *,
    tokenizer: str = "bpe",
    vocab_size: int = 1024,
    val_fraction: float = 0.1,
    progress: bool = True,
) -> dict:
    """Tokenizes ``inputs`` (paths or globs) into ``out``; returns the metadata written."""
    from tqdm.auto import tqdm

    files = expand(inputs)
    if not files:
        raise FileNotFoundError("data prepare: no input files")
    tok = _build_tokenizer(tokenizer, files, vocab_size)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    digest, total, sources = hashlib.sha256(), 0, []
    tmp = out / (TOKENS_FILE + ".tmp")
    batch = getattr(tok, "encode_batch", None)  # the Rust tokenizers encode chunks in parallel
    size = sum(f.stat().st_size for f in files)
    with (
        tmp.open("wb") as sink,
        tqdm(total=size, unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for f in files:
            text = _read(f)
            pieces = list(_chunks(text))
            encoded = batch(pieces) if batch else [tok.encode(p) for p in pieces]
            count = 0
            for ids in encoded:
                data = np.asarray(ids).astype(dtype).tobytes()
                sink.write(data)
                digest.update(data)
                count += len(ids)
            total += count
            sources.append({"path": str(f), "bytes": f.stat().st_size, "tokens": count})
            bar.update(f.stat().st_size)
    os.replace(tmp, out / TOKENS_FILE)
    tok.save(out / TOKENIZER_FILE)
    n_train = len(split_train_val(np.empty(total, np.uint8), val_fraction)[0])
    meta = {
        "format": 1,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_kind": tok.kind,
        "vocab_size": int(tok.vocab_size),
        "dtype": dtype.name,
        "tokens": total,
        "train_tokens": n_train,
        "val_tokens": total - n_train,
        "val_fraction": val_fraction,
        "sha256": digest.hexdigest(),
        "sources": sources,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def open_prepared(path):
    """(meta, tokenizer, tokens): the metadata, the tokenizer and a read-only memory map."""
    path = pathlib.Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(
            f"data.path={str(path)!r} is not a prepared corpus (no {META_FILE}); write one with "
            "`attnlab data prepare FILES... --out DIR`"
        )
    meta = json.loads((path / META_FILE).read_text())
    dtype = np.dtype(meta["dtype"])
    expected = meta["tokens"] * dtype.itemsize
    actual = (path / TOKENS_FILE).stat().st_size
    if actual != expected:
        raise ValueError(f"{path / TOKENS_FILE} has {actual} bytes; {META_FILE} says {expected}")
    tokens = np.memmap(path / TOKENS_FILE, dtype=dtype, mode="r", shape=(meta["tokens"],))
    return meta, load_tokenizer(path / meta["tokenizer"]), tokens


def verify(path) -> bool:
    """Whether ``tokens.bin`` still has the SHA-256 recorded in ``meta.json``."""
    from attnlab.data.fetch import sha256_of

    meta = json.loads((pathlib.Path(path) / META_FILE).read_text())
    return sha256_of(pathlib.Path(path) / TOKENS_FILE) == meta["sha256"]


def prepared_task(cfg, workdir=None, host=(0, 1)):
    """The language-model task of a prepared corpus (``data.path``)."""
    from attnlab.data.tasks import TOKENIZER_FILE as RUN_TOKENIZER
    from attnlab.data.tasks import config_field, token_task

    path = pathlib.Path(config_field(cfg, "path"))
    meta, tok, tokens = open_prepared(path)
    if workdir is not None and not (pathlib.Path(workdir) / RUN_TOKENIZER).exists():
        pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path / meta["tokenizer"], pathlib.Path(workdir) / RUN_TOKENIZER)
    n = meta["train_tokens"]
    return token_task(cfg, "prepared", tok, tokens[:n], tokens[n:], host=host)
