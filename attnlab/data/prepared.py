"""Corpora prepared once: text files tokenized into one memory-mapped token file.

``prepare(inputs, out, tokenizer=...)`` writes ``DIR/tokens.bin`` (uint16 ids when the
vocabulary fits, else uint32; the files' tokens one after another), ``DIR/tokenizer.json``
and ``DIR/meta.json`` (tokenizer, counts, the split, a SHA-256 and a CRC-32 of
``tokens.bin``). The first ``train_tokens`` ids are the training split, the rest validation
(the in-memory split of the same stream). ``data.kind="prepared"`` with ``data.path=DIR``
trains on it: batches index the memory map, so only the windows a batch needs are read and a
corpus larger than RAM works.

The three files are written beside their final names and renamed only once all are complete:
a missing input, an unwritable ``--out`` or a full disk is a ``DataError`` that leaves an
earlier corpus in ``--out`` as it was and no ``.tmp`` file behind. Opening checks
``meta.json`` (present, JSON, written by ``prepare``), the size of ``tokens.bin`` and its
CRC-32 against it (SHA-256 for corpora written before the CRC-32 was recorded; the cost is in
docs/guides/checkpoints.md, once per file and process), and every id against the tokenizer
(files over ``SCAN_BYTES``: batch by batch, a ``TokenIdError``), so a missing, truncated,
edited or foreign file is a ``PreparedCorpusError`` naming the file and the command that
rewrites it.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import pathlib
import shutil
import zlib

import numpy as np

from attnlab.data.checksums import file_checksum
from attnlab.data.corpus import split_train_val
from attnlab.data.tasks import TOKENIZER_FILE as RUN_TOKENIZER
from attnlab.data.tasks import config_field
from attnlab.data.text import token_task
from attnlab.data.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer
from attnlab.errors import DataError, DataFileError, PreparedCorpusError, one_line

TOKENS_FILE, META_FILE, TOKENIZER_FILE = "tokens.bin", "meta.json", "tokenizer.json"
DOCUMENTS_FILE = "documents.npy"  # int64 end offsets of the documents in tokens.bin
CHUNK_CHARS = 1 << 20
SCAN_BYTES = 1 << 31  # token files up to this size have every id checked when opened


def expand(inputs) -> list[pathlib.Path]:
    """Input files from paths and glob patterns, in order, each once."""
    found: list[pathlib.Path] = []
    for pattern in inputs:
        matches = sorted(glob.glob(str(pattern), recursive=True)) or [str(pattern)]
        for m in matches:
            path = pathlib.Path(m)
            if not path.is_file():
                raise DataFileError(
                    f"data prepare: no such file {m!r}; pass existing text files or glob patterns"
                )
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


def build_tokenizer(spec: str, texts, vocab_size: int):
    """The tokenizer ``spec`` names; "char" and "bpe" are built from ``texts()`` (strings)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "char":
        return CharTokenizer.from_text("".join(sorted({c for t in texts() for c in t})))
    if spec == "bpe":
        from attnlab.data.bpe import train_bpe

        return train_bpe(texts(), vocab_size)
    return load_tokenizer(spec)


def _read(path) -> str:
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data prepare: {str(path)!r} is not UTF-8 text (byte {e.start}); convert it to UTF-8 "
            "or leave it out"
        ) from None
    except OSError as e:
        raise DataError(f"data prepare: cannot read {str(path)!r} ({e.strerror})") from None


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
    files = expand(inputs)
    if not files:
        raise DataFileError("data prepare: no input files; pass text files or glob patterns")
    tok = build_tokenizer(tokenizer, lambda: (_read(f) for f in files), vocab_size)
    sources = [
        (str(f), f.stat().st_size, lambda f=f: _chunks(_read(f)))  # one document per file
        for f in files
    ]
    return write_prepared(sources, out, tok, val_fraction=val_fraction, progress=progress)


def write_prepared(sources, out, tok, *, val_fraction: float = 0.1, progress=True) -> dict:
    """Writes the prepared corpus of ``sources`` into ``out`` with tokenizer ``tok``.

    ``sources``: ``(name, bytes, pieces)`` per document, ``pieces()`` the document's text in
    pieces that end at line ends; their tokens are written one after another. A fourth item
    True makes each piece a document of its own (the records of a data set).
    """
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    out = pathlib.Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        return _write(sources, out, tok, dtype, val_fraction, progress)
    except OSError as e:
        raise DataError(
            f"data prepare: cannot write {out} ({e.strerror or one_line(e)}); nothing was "
            "replaced: free some space or choose another --out"
        ) from None
    finally:
        for name in (TOKENS_FILE, TOKENIZER_FILE, DOCUMENTS_FILE, META_FILE):
            if (out / (name + ".tmp")).is_file():
                (out / (name + ".tmp")).unlink()


def _encoded(tok, pieces, group: int = 256):
    """The ids of each piece, encoded ``group`` pieces at a time (the Rust tokenizers
    encode a group in parallel)."""
    batch = getattr(tok, "encode_batch", None)
    pieces = iter(pieces)
    while chunk := list(itertools.islice(pieces, group)):
        yield from (batch(chunk) if batch else [tok.encode(p) for p in chunk])


def _write(sources, out, tok, dtype, val_fraction, progress) -> dict:
    from tqdm.auto import tqdm

    digest, crc, total, written, ends = hashlib.sha256(), 0, 0, [], []
    tmp = out / (TOKENS_FILE + ".tmp")
    size = sum(s[1] for s in sources)
    with (
        tmp.open("wb") as sink,
        tqdm(total=size, unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for name, nbytes, pieces, *each in sources:
            count = 0
            for ids in _encoded(tok, pieces()):
                data = np.asarray(ids).astype(dtype).tobytes()
                sink.write(data)
                digest.update(data)
                crc = zlib.crc32(data, crc)
                count += len(ids)
                if each and each[0] and len(ids):
                    ends.append(total + count)
            total += count
            if not (each and each[0]) and count:
                ends.append(total)
            written.append({"path": name, "bytes": nbytes, "tokens": count})
            bar.update(nbytes)
    tok.save(out / (TOKENIZER_FILE + ".tmp"))
    with (out / (DOCUMENTS_FILE + ".tmp")).open("wb") as f:
        np.save(f, np.asarray(ends, np.int64))
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
        "crc32": f"{crc:08x}",  # what opening verifies (SHA-256 for corpora without it)
        "documents": len(ends),
        "sources": written[:1000],  # the first thousand; every document's end: documents.npy
    }
    (out / (META_FILE + ".tmp")).write_text(json.dumps(meta, indent=1) + "\n")
    for name in (TOKENS_FILE, TOKENIZER_FILE, DOCUMENTS_FILE, META_FILE):  # all written
        os.replace(out / (name + ".tmp"), out / name)
    return meta


_META_KEYS = ("format", "tokenizer", "vocab_size", "dtype", "tokens", "train_tokens")


def _read_meta(path: pathlib.Path) -> dict:
    rewrite = f"rewrite it with `attnlab data prepare FILES... --out {path}`"
    if not path.is_dir():
        raise PreparedCorpusError(
            f"data.path={str(path)!r} is not a directory; write a prepared corpus there with "
            "`attnlab data prepare FILES... --out DIR`"
        )
    if not (path / META_FILE).is_file():
        raise PreparedCorpusError(
            f"data.path={str(path)!r} is not a prepared corpus (no {META_FILE}); write one with "
            "`attnlab data prepare FILES... --out DIR`"
        )
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PreparedCorpusError(
            f"{path / META_FILE} cannot be read ({one_line(e)}); {rewrite}"
        ) from None
    missing = [k for k in _META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing or meta.get("format") != 1:
        raise PreparedCorpusError(
            f"{path / META_FILE} was not written by `attnlab data prepare` (format "
            f"{meta.get('format') if isinstance(meta, dict) else None!r}, missing {missing}); "
            f"{rewrite}"
        )
    try:
        np.dtype(meta["dtype"])
    except TypeError:
        raise PreparedCorpusError(
            f"{path / META_FILE}: unknown dtype {meta['dtype']!r}; {rewrite}"
        ) from None
    return meta


def open_prepared(path):
    """(meta, tokenizer, tokens): the metadata, the tokenizer and a read-only memory map."""
    path = pathlib.Path(path)
    meta = _read_meta(path)
    rewrite = f"rewrite it with `attnlab data prepare FILES... --out {path}`"
    dtype = np.dtype(meta["dtype"])
    expected = int(meta["tokens"]) * dtype.itemsize
    tokens_file = path / TOKENS_FILE
    if not tokens_file.is_file():
        raise PreparedCorpusError(f"{tokens_file} is missing; {rewrite}")
    actual = tokens_file.stat().st_size
    if actual != expected:
        what = "cut short" if actual < expected else "longer than recorded"
        raise PreparedCorpusError(
            f"{tokens_file} is {what}: {actual} bytes where {META_FILE} records {expected} "
            f"({meta['tokens']} {dtype.name} ids); it was truncated or belongs to another "
            f"corpus: {rewrite}"
        )
    tok = load_tokenizer(path / meta["tokenizer"])
    if tok.vocab_size != int(meta["vocab_size"]):
        raise PreparedCorpusError(
            f"{path / meta['tokenizer']} has {tok.vocab_size} ids where {META_FILE} records "
            f"{meta['vocab_size']}: the tokenizer belongs to another corpus; {rewrite}"
        )
    if int(meta["tokens"]) == 0:
        raise PreparedCorpusError(f"{tokens_file} holds no tokens; {rewrite} from non-empty text")
    tokens = np.memmap(tokens_file, dtype=dtype, mode="r", shape=(int(meta["tokens"]),))
    if actual <= SCAN_BYTES:  # larger corpora are checked batch by batch (Task)
        top = max(int(tokens[i : i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24))
        if top >= tok.vocab_size:
            raise PreparedCorpusError(
                f"{tokens_file} holds id {top}, outside the {tok.vocab_size} ids of its "
                f"tokenizer {path / meta['tokenizer']}: the file belongs to another corpus or "
                f"tokenizer; {rewrite}"
            )
    _check_checksum(tokens_file, meta, rewrite)  # after the ids: their message is more precise
    return meta, tok, tokens


# The token files verified in this process, by what identifies one version of a file: a
# second open of the same corpus (the evaluation's task, a sweep's next trial) reads none.
_VERIFIED: set[tuple] = set()


def _check_checksum(tokens_file: pathlib.Path, meta: dict, rewrite: str):
    """Refuses a token file whose checksum differs from the one ``meta.json`` records (CRC-32,
    or SHA-256 for corpora written before CRC-32 was recorded; none for a hand-made
    ``meta.json`` that records neither)."""
    name = next((k for k in ("crc32", "sha256") if k in meta), None)
    stat = tokens_file.stat()
    key = (str(tokens_file.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, name)
    if name is None or key in _VERIFIED:
        return
    if file_checksum(tokens_file, name) != str(meta[name]):
        raise PreparedCorpusError(
            f"{tokens_file} does not match the {name} checksum recorded in {META_FILE}: it "
            f"changed after it was written; {rewrite}"
        )
    _VERIFIED.add(key)


def document_ends(path, meta) -> np.ndarray:
    """The end offset of every document in ``tokens.bin`` (one document for corpora written
    before ``documents.npy`` was)."""
    file = pathlib.Path(path) / DOCUMENTS_FILE
    if not file.is_file():
        return np.array([int(meta["tokens"])], np.int64)
    ends = np.load(file)
    if ends.ndim != 1 or (
        len(ends) and (ends[-1] != int(meta["tokens"]) or (np.diff(ends) <= 0).any())
    ):
        raise PreparedCorpusError(
            f"{file} does not match {META_FILE}; rewrite it with `attnlab data prepare FILES... "
            f"--out {path}`"
        )
    return ends


def verify(path) -> bool:
    """Whether ``tokens.bin`` still has the SHA-256 recorded in ``meta.json``."""
    meta = _read_meta(pathlib.Path(path))
    return file_checksum(pathlib.Path(path) / TOKENS_FILE, "sha256") == meta["sha256"]


def prepared_task(cfg, workdir=None, host=(0, 1)):
    """The language-model task of a prepared corpus (``data.path``)."""
    path = pathlib.Path(config_field(cfg, "path"))
    meta, tok, tokens = open_prepared(path)
    if workdir is not None and not (pathlib.Path(workdir) / RUN_TOKENIZER).exists():
        pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path / meta["tokenizer"], pathlib.Path(workdir) / RUN_TOKENIZER)
    n = meta["train_tokens"]
    ends = document_ends(path, meta)
    return token_task(cfg, "prepared", tok, tokens[:n], tokens[n:], host=host, documents=ends)
