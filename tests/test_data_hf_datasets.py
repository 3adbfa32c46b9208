"""Hugging Face data sets on disk (``data.source="hf_datasets"``): tokenised once, cached as a
prepared corpus, batches equal to the same text's in-memory batches."""

import json

import numpy as np
import pytest

from attnlab.data import make_task
from attnlab.errors import DataError

datasets = pytest.importorskip("datasets")

RECORDS = [
    {"id": i, "text": f"Record {i}: the quick brown fox jumps over the lazy dog {i * 7}."}
    for i in range(60)
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))


def _write(tmp_path, fmt):
    ds = datasets.Dataset.from_list(RECORDS)
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow"])
def test_hf_datasets_batches_equal_the_texts_in_memory(tmp_path, fmt):
    path = _write(tmp_path, fmt)
    text = "".join(r["text"] + "\n\n" for r in RECORDS)  # one blank line after each record
    (tmp_path / "all.txt").write_text(text)
    # windows read by index: the same ids give the same batches, whatever the documents
    common = {"tokenizer": "byte", "seq_len": 16, "pipeline": "index"}
    cfg = {"source": "hf_datasets", "path": str(path), **common}
    task = make_task(cfg, tmp_path / "run")
    memory = make_task({"path": str(tmp_path / "all.txt"), **common})
    ids = np.frombuffer(text.encode(), np.uint8)
    assert np.array_equal(np.concatenate([task.train_ids, task.val_ids]), ids)
    for step in (0, 5):
        a, b = memory.train_batch(1, step, 4), task.train_batch(1, step, 4)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert (tmp_path / "run" / "tokenizer.json").is_file()
    prepared = list((tmp_path / "cache" / "prepared").iterdir())
    assert len(prepared) == 1  # tokenised once: a second task memory-maps the same corpus
    lengths = [len((r["text"] + "\n\n").encode()) for r in RECORDS]  # a record, a document
    assert np.load(prepared[0] / "documents.npy").tolist() == np.cumsum(lengths).tolist()
    stamp = (prepared[0] / "tokens.bin").stat().st_mtime_ns
    make_task(cfg, tmp_path / "run")
    assert list((tmp_path / "cache" / "prepared").iterdir()) == prepared
    assert (prepared[0] / "tokens.bin").stat().st_mtime_ns == stamp


def test_a_char_tokenizer_is_built_from_the_records_and_kept_by_the_run(tmp_path):
    path = _write(tmp_path, "jsonl")
    cfg = {"source": "hf_datasets", "path": str(path), "tokenizer": "char", "seq_len": 8}
    task = make_task(cfg, tmp_path / "run")
    chars = sorted(set("".join(r["text"] + "\n\n" for r in RECORDS)))
    assert task.vocab_size == len(chars)
    assert task.decode(task.train_ids[:9]) == RECORDS[0]["text"][:9]


def test_bad_hf_datasets_settings_name_the_field(tmp_path):
    path = _write(tmp_path, "jsonl")
    cfg = {"source": "hf_datasets", "path": str(path), "tokenizer": "byte", "seq_len": 8}
    with pytest.raises(DataError, match="data.text_field='body'.*'id', 'text'"):
        make_task({**cfg, "text_field": "body"})
    with pytest.raises(DataError, match="data.text_field='id': record 0 holds int"):
        make_task({**cfg, "text_field": "id"})
    with pytest.raises(DataError, match="data.source must be one of"):
        make_task({**cfg, "source": "hub"})
    with pytest.raises(DataError, match="no data set there"):
        make_task({**cfg, "path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(DataError, match="set data.kind='text'"):
        make_task({**cfg, "kind": "mlm_text"})
