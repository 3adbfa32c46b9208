"""Hugging Face ``datasets`` on local disk as a training source: ``data.source="hf_datasets"``.

``data.path`` names a data set saved with ``Dataset.save_to_disk`` (a directory), or Arrow
(``.arrow``), Parquet (``.parquet``) or JSON Lines (``.jsonl``, ``.json``) files: a file, a
glob or a directory of them; ``data.text_field`` names the column that holds the text. A
``DatasetDict`` gives its ``train`` split.

The records are tokenised once, with the run's tokenizer (the ``tokenizer.json`` its work
directory keeps, else ``data.tokenizer``: "byte", "char" or "bpe" built from the records, or
a path), into a prepared corpus (``attnlab.data.prepared``) in the cache,
``CACHE/prepared/KEY`` (``CACHE`` as in ``attnlab.data.fetch``); ``KEY`` is a SHA-256 of the
files' paths, sizes and modification times, the text field, the tokenizer and the split, so
an edited data set or another tokenizer is prepared anew and everything else is memory-mapped
from the cache. Each record is one document, followed by a blank line (``"\\n\\n"``).
``data.kind`` stays ``"text"``: the run is a language model over the prepared tokens.
"""

from __future__ import annotations

import glob
import hashlib
import json
import pathlib

from attnlab.data import prepared
from attnlab.data.fetch import cache_dir, sha256_of
from attnlab.data.tasks import _DEFAULTS, TOKENIZER_FILE, config_field
from attnlab.errors import DataError, DataFileError, one_line, optional_import

FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
SEPARATOR = "\n\n"


def _datasets():
    return optional_import("datasets", "datasets", "data.source='hf_datasets'")


def data_files(path) -> list[pathlib.Path]:
    """The files of ``path`` (a saved data set's directory gives itself)."""
    p = pathlib.Path(path)
    if p.is_dir():
        if any((p / m).is_file() for m in SAVED_MARKERS):
            return [p]
        found = sorted(f for f in p.rglob("*") if f.suffix in FORMATS and f.is_file())
    else:
        found = [pathlib.Path(m) for m in sorted(glob.glob(str(path), recursive=True))]
    if not found:
        raise DataFileError(
            f"data.path={str(path)!r}: no data set there; point it at a directory written by "
            f"save_to_disk or at {', '.join(FORMATS)} files"
        )
    kinds = {FORMATS.get(f.suffix) for f in found}
    if None in kinds or len(kinds) > 1:
        raise DataError(
            f"data.path={str(path)!r} matches {sorted({f.suffix for f in found})} files: "
            f"use files of one format among {', '.join(FORMATS)}"
        )
    return found


def load_records(path):
    """The ``datasets.Dataset`` at ``path`` (its ``train`` split for a ``DatasetDict``)."""
    datasets = _datasets()
    files = data_files(path)
    shown = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # its conversion's bars are not the run's output
    try:
        if files[0].is_dir():
            ds = datasets.load_from_disk(str(files[0]))
        else:
            ds = datasets.load_dataset(
                FORMATS[files[0].suffix],
                data_files=[str(f) for f in files],
                split="train",
                cache_dir=str(cache_dir() / "hf_datasets"),
            )
    except Exception as e:  # the datasets library raises many kinds
        raise DataError(
            f"data.path={str(path)!r} cannot be read as a data set ({one_line(e)})"
        ) from None
    finally:
        if shown:
            datasets.enable_progress_bars()
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(
                f"data.path={str(path)!r} holds the splits {sorted(ds)} and no 'train': save "
                "the split to train on alone"
            )
        ds = ds["train"]
    return ds


def _texts(ds, field: str):
    if field not in ds.column_names:
        raise DataError(
            f"data.text_field={field!r} is not a column of the data set; it has "
            f"{ds.column_names}: set --config.data.text_field to one of them"
        )
    for i, text in enumerate(ds[field]):
        if not isinstance(text, str):
            raise DataError(
                f"data.text_field={field!r}: record {i} holds {type(text).__name__}, not text; "
                "choose a text column"
            )
        yield text + SEPARATOR


def _tokenizer_spec(cfg) -> tuple[str, str]:
    """(data.tokenizer, what it is for the cache key)."""
    spec = config_field(cfg, "tokenizer")
    if spec in ("byte", "char", "bpe"):
        return spec, f"{spec}:{config_field(cfg, 'vocab_size') if spec == 'bpe' else ''}"
    if not pathlib.Path(spec).is_file():
        raise DataFileError(
            f"data.tokenizer={spec!r}: no such tokenizer file; use 'byte', 'char', 'bpe' or "
            "the path of a tokenizer.json"
        )
    return spec, sha256_of(spec)


def cache_key(cfg, files, tokenizer_key: str) -> str:
    stats = [(str(f.resolve()), *_stat(f)) for f in files]
    record = [stats, config_field(cfg, "text_field"), tokenizer_key]
    record.append(config_field(cfg, "val_fraction"))
    return hashlib.sha256(json.dumps(record).encode()).hexdigest()[:24]


def _stat(path: pathlib.Path) -> tuple[int, int]:
    paths = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    return sum(f.stat().st_size for f in paths), max(f.stat().st_mtime_ns for f in paths)


def prepare_cached(cfg, workdir=None, progress: bool = False) -> pathlib.Path:
    """The prepared corpus of ``data.path``, written into the cache on first use."""
    path, field = config_field(cfg, "path"), config_field(cfg, "text_field")
    if not path:
        raise DataError("data.source='hf_datasets' needs data.path: the data set on disk")
    files = data_files(path)
    spec, tok_key = _tokenizer_spec(cfg)
    out = cache_dir() / "prepared" / cache_key(cfg, files, tok_key)
    kept = None if workdir is None else pathlib.Path(workdir) / TOKENIZER_FILE
    if kept is not None and kept.is_file():  # the run's tokenizer, whatever the cache holds
        built = out / prepared.TOKENIZER_FILE
        if not (built.is_file() and sha256_of(built) == sha256_of(kept)):
            spec = str(kept)
            out = cache_dir() / "prepared" / cache_key(cfg, files, sha256_of(kept))
    if (out / prepared.META_FILE).is_file():
        return out
    ds = load_records(path)
    tok = prepared.build_tokenizer(spec, lambda: _texts(ds, field), config_field(cfg, "vocab_size"))
    size = sum(_stat(f)[0] for f in files)
    sources = [(str(path), size, lambda: _texts(ds, field), True)]  # a record, a document
    prepared.write_prepared(
        sources, out, tok, val_fraction=config_field(cfg, "val_fraction"), progress=progress
    )
    return out


def hf_task(cfg, workdir=None, host=(0, 1)):
    """The language-model task over the prepared tokens of a ``datasets`` data set."""
    if config_field(cfg, "kind") != "text":
        raise DataError(
            f"data.source='hf_datasets' trains a language model: set data.kind='text' "
            f"(got {config_field(cfg, 'kind')!r})"
        )
    out = prepare_cached(cfg, workdir)
    fields = {k: config_field(cfg, k) for k in _DEFAULTS}
    return prepared.prepared_task({**fields, "path": str(out)}, workdir, host=host)
