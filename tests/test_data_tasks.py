"""Tasks: every kind builds, batches are pure functions of (seed, step), ids are checked."""

import functools
import pathlib
import tempfile
import types

import numpy as np
import pytest

from attnlab.data import (
    TASK_KINDS,
    CharTokenizer,
    Task,
    batch_rng,
    load_tokenizer,
    make_task,
    stdlib_corpus,
)

SEQ_LEN, BATCH = 32, 8
FIELDS = {
    "lm": {"inputs": np.int32, "targets": np.int32, "loss_mask": np.float32},
    "seq2seq": {
        "src": np.int32,
        "src_valid": np.bool_,
        "tgt_in": np.int32,
        "tgt_out": np.int32,
        "loss_mask": np.float32,
    },
    "mlm": {"inputs": np.int32, "targets": np.int32, "loss_mask": np.float32, "valid": np.bool_},
}
# Language-model text is packed by Grain (data.pipeline="grain", the default): its rows say
# which document each token belongs to and where in it it stands.
PACKED = {"segment_ids": np.int32, "positions": np.int32}


@functools.cache
def _prepared_corpus() -> str:
    """A byte-level prepared corpus of the embedded text (made once per session)."""
    from attnlab.data.prepared import prepare

    root = pathlib.Path(tempfile.mkdtemp(prefix="attnlab-prepared-"))
    (root / "corpus.txt").write_text(stdlib_corpus(50_000))
    prepare([root / "corpus.txt"], root / "prepared", tokenizer="byte", progress=False)
    return str(root / "prepared")


def _cfg(kind, **overrides):
    if kind == "prepared":
        overrides = {"path": _prepared_corpus(), **overrides}
    if kind == "length_task":  # a kind that needs its tasks named
        overrides = {"tasks": "copy,reverse", **overrides}
    return {"kind": kind, "seq_len": SEQ_LEN, "max_chars": 50_000, **overrides}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def _differs(a, b):
    return any(not np.array_equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_every_kind_builds_and_batches(kind):
    task = make_task(_cfg(kind))
    batch = task.train_batch(seed=0, step=0, batch_size=BATCH)
    fields = FIELDS[task.kind] | (PACKED if kind in ("text", "prepared") else {})
    assert batch.keys() == fields.keys()
    for key, dtype in fields.items():
        assert batch[key].dtype == dtype, key
        assert batch[key].shape == (BATCH, SEQ_LEN), key
    for key in ("inputs", "targets", "src", "tgt_in", "tgt_out"):
        if key in batch:
            assert batch[key].min() >= 0 and batch[key].max() < task.vocab_size
    assert batch["loss_mask"].sum() > 0
    assert isinstance(task.decode(batch[next(iter(batch))][0]), str)
    assert isinstance(task.describe(batch), str)


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_batches_are_pure_functions_of_seed_and_step(kind):
    task = make_task(_cfg(kind))
    _assert_same(task.train_batch(1, 5, BATCH), task.train_batch(1, 5, BATCH))
    assert _differs(task.train_batch(1, 5, BATCH), task.train_batch(1, 6, BATCH))
    assert _differs(task.train_batch(1, 5, BATCH), task.train_batch(2, 5, BATCH))


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_eval_batches_are_fixed(kind):
    task = make_task(_cfg(kind))
    first, second = task.eval_batches(BATCH, 3), task.eval_batches(BATCH, 3)
    assert len(first) == 3
    for a, b in zip(first, second, strict=True):
        _assert_same(a, b)
    assert _differs(first[0], first[1])
    assert _differs(first[0], task.train_batch(0, 0, BATCH))


def test_text_lm_targets_are_inputs_shifted():
    task = make_task(_cfg("text"))
    batch = task.train_batch(0, 0, BATCH)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    np.testing.assert_array_equal(batch["loss_mask"], 1.0)
    train = task.train_ids
    for row in np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1):
        starts = np.flatnonzero(train[: len(train) - SEQ_LEN] == row[0])
        assert any(np.array_equal(train[s : s + SEQ_LEN + 1], row) for s in starts)


def test_text_eval_reads_the_validation_split():
    task = make_task(_cfg("text"))
    val = task.val_ids
    for batch in task.eval_batches(4, 2):
        for row in batch["inputs"]:
            starts = np.flatnonzero(val[: len(val) - SEQ_LEN] == row[0])
            assert any(np.array_equal(val[s : s + SEQ_LEN], row) for s in starts)


def test_text_encode_decode():
    task = make_task(_cfg("text"))
    text = "def f(x):\n    return x\n"
    assert task.decode(task.encode(text)) == text
    assert task.tokenizer.vocab_size == task.vocab_size
    byte_task = make_task(_cfg("text", tokenizer="byte"))
    assert byte_task.vocab_size == 256
    assert byte_task.decode(byte_task.encode("é—x")) == "é—x"


def test_mlm_text_mask_id_and_decode():
    task = make_task(_cfg("mlm_text"))
    assert task.mask_id == task.vocab_size - 1 == task.tokenizer.vocab_size
    batch = task.train_batch(0, 0, BATCH)
    assert np.any(batch["inputs"] == task.mask_id)
    assert "[MASK]" in task.decode(batch["inputs"][np.any(batch["inputs"] == task.mask_id, 1)][0])


def test_synthetic_special_ids_and_text():
    task = make_task(_cfg("reverse", num_symbols=6))
    assert (task.pad_id, task.bos_id, task.eos_id, task.vocab_size) == (0, 1, 2, 10)
    np.testing.assert_array_equal(task.encode(task.decode([1, 4, 9, 3])), [1, 4, 9, 3])
    assert task.tokenizer is None


def test_attribute_config_and_lengths():
    cfg = types.SimpleNamespace(kind="copy", seq_len=SEQ_LEN, num_symbols=5, min_len=3, max_len=4)
    batch = make_task(cfg).train_batch(0, 0, 64)
    assert set(batch["loss_mask"].sum(axis=1).tolist()) == {3.0, 4.0}


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="data.kind") as info:
        make_task({"kind": "translation"})
    assert all(kind in str(info.value) for kind in TASK_KINDS)


def test_max_len_too_long_names_the_field():
    with pytest.raises(ValueError, match="data.max_len"):
        make_task(_cfg("sort", max_len=SEQ_LEN))


def test_missing_path_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="leave data.path empty"):
        make_task(_cfg("text", path=str(tmp_path / "missing.txt")))


def test_workdir_tokenizer_is_saved_then_reused(tmp_path):
    first_corpus, second_corpus = tmp_path / "a.txt", tmp_path / "b.txt"
    first_corpus.write_text("abcdefgh" * 200)
    second_corpus.write_text("hgfedcb" * 200)  # fewer characters, so a fresh vocab would differ
    workdir = tmp_path / "run"
    first = make_task(_cfg("text", path=str(first_corpus)), workdir=workdir)
    saved = load_tokenizer(workdir / "tokenizer.json")
    assert saved == first.tokenizer == CharTokenizer("abcdefgh")
    second = make_task(_cfg("text", path=str(second_corpus)), workdir=workdir)
    assert second.tokenizer == saved and second.vocab_size == 8
    np.testing.assert_array_equal(second.encode("abc"), first.encode("abc"))
    second_corpus.write_text("xyz" * 500)
    with pytest.raises(ValueError, match="tokenizer.json"):
        make_task(_cfg("text", path=str(second_corpus)), workdir=workdir)


def test_batches_are_validated_before_return():
    def sample(rng, batch_size):
        ids = np.full((batch_size, 4), 9, np.int32)
        return {"inputs": ids, "targets": ids, "loss_mask": np.ones((batch_size, 4), np.float32)}

    task = Task(name="broken", kind="lm", vocab_size=5, sample=sample, decode=str)
    with pytest.raises(ValueError, match=r"batch\['inputs'\].*id 9.*\[0, 5\)"):
        task.train_batch(0, 0, 2)
    with pytest.raises(ValueError, match="inputs"):
        task.eval_batches(2, 1)


def test_batch_rng_rejects_negative_seeds():
    with pytest.raises(ValueError, match=">= 0"):
        batch_rng(-1, 0)


def test_tiny_shakespeare_task(shared_dir, tmp_path):
    path = shared_dir / "data" / "tinyshakespeare.txt"
    task = make_task(_cfg("text", path=str(path), max_chars=0), workdir=tmp_path)
    assert task.vocab_size == 65
    assert (len(task.train_ids), len(task.val_ids)) == (1_003_854, 111_540)
    assert (tmp_path / "tokenizer.json").exists()
    assert (
        task.decode(task.eval_batches(1, 1)[0]["inputs"][0])
        == path.read_text()[1_003_854:][:SEQ_LEN]
    )
