"""Corpora: file loading, the embedded standard-library corpus and the train/val split."""

import ast
import pathlib

import numpy as np
import pytest

from attnlab.data import CharTokenizer, corpus, load_text, split_train_val, stdlib_corpus
from attnlab.errors import DataError

DATA_DIR = pathlib.Path(corpus.__file__).parent


def test_load_text_reads_utf8(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo\n", encoding="utf-8")
    assert load_text(path) == "héllo\n"


def test_load_text_missing_file_explains(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError) as info:
        load_text(missing)
    assert str(missing) in str(info.value)
    assert "leave data.path empty" in str(info.value)


def test_stdlib_corpus_is_deterministic():
    first = stdlib_corpus(100_000)
    stdlib_corpus.cache_clear()
    second = stdlib_corpus(100_000)
    assert first is not second
    assert len(first) == 100_000
    assert first == second
    assert "def " in first and "import " in first


def test_stdlib_corpus_prefix_property():
    assert stdlib_corpus(100_000).startswith(stdlib_corpus(30_000))


def test_stdlib_default_size():
    assert len(stdlib_corpus()) == corpus.DEFAULT_MAX_CHARS


def test_stdlib_source_files_are_a_fixed_sorted_subset():
    files = corpus.stdlib_source_files()
    assert files == sorted(files)
    assert len(files) > 100
    assert all(f.endswith(".py") for f in files)
    skipped = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    assert not any(skipped & set(f.split("/")[:-1]) for f in files)
    assert not any(f.split("/")[-1].startswith("_sysconfigdata") for f in files)


def test_split_takes_the_last_fraction_for_validation():
    ids = np.arange(100)
    train, val = split_train_val(ids, 0.1)
    np.testing.assert_array_equal(train, np.arange(90))
    np.testing.assert_array_equal(val, np.arange(90, 100))
    train, val = split_train_val(ids, 0.0)
    assert len(train) == 100 and len(val) == 0


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(np.arange(10), fraction)


def test_tiny_shakespeare_split(shared_dir):
    text = load_text(shared_dir / "data" / "tinyshakespeare.txt")
    tok = CharTokenizer.from_text(text)
    train, val = split_train_val(tok.encode(text), 0.1)
    assert tok.vocab_size == 65
    assert (len(train), len(val)) == (1_003_854, 111_540)


def test_data_package_imports_no_model_code():
    """attnlab.data is NumPy only: no flax, jax, attnlab.nn or attnlab.config."""
    banned = ("flax", "jax", "attnlab.nn", "attnlab.config")
    for path in DATA_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not any(name == b or name.startswith(b + ".") for b in banned), (path, name)


def test_the_embedded_corpus_as_documents_ends_each_with_its_own_id():
    from attnlab.data import make_task

    text = corpus.stdlib_documents(20_000)
    pieces = text.split(corpus.END_OF_DOCUMENT)
    assert len(text) <= 20_000 and len(pieces) > 20
    assert all(p and not p.startswith("\n") for p in pieces[:-1])  # no empty document
    ids = np.array([5, 1, 3, 2, 3, 7])
    np.testing.assert_array_equal(corpus.document_ends(ids, 3), [3, 5, 6])
    np.testing.assert_array_equal(corpus.document_ends(ids[:5], 3), [3, 5])
    cfg = {"kind": "text", "path": corpus.EMBEDDED_DOCUMENTS, "seq_len": 16, "max_chars": 20_000}
    task = make_task(cfg)
    assert corpus.END_OF_DOCUMENT in task.tokenizer.chars
    batch = task.train_batch(0, 0, 8)
    assert batch["segment_ids"].shape == (8, 16)
    with pytest.raises(DataError, match="data.tokenizer='char' or 'byte'"):
        make_task({**cfg, "tokenizer": "bpe", "vocab_size": 300})
