"""Multi-query associative recall (``data.kind="mqar"``): a hand-made row, the answers the loss
counts, and the settings' errors."""

import numpy as np
import pytest

from attnlab.data import make_task, synthetic
from attnlab.data.synthetic import BOS, SEP
from attnlab.errors import DataError


def test_a_hand_made_row():
    # Two pairs (keys 5, 4; values 9, 8), then pair 1 queried at offset 0, pair 0 at offset 3.
    batch = synthetic.mqar_rows(
        np.array([[5, 4]]), np.array([[9, 8]]), np.array([[1, 0]]), np.array([[0, 3]]),
        np.array([2]), 12,
    )  # fmt: skip
    row = [BOS, 5, 9, 4, 8, 4, 8, SEP, 5, 9, SEP, SEP, SEP]
    np.testing.assert_array_equal(batch["inputs"][0], row[:-1])
    np.testing.assert_array_equal(batch["targets"][0], row[1:])
    expected = np.zeros(12, np.float32)
    expected[[5, 8]] = 1  # the targets 8 (after the query 4) and 9 (after the query 5)
    np.testing.assert_array_equal(batch["loss_mask"][0], expected)


def test_every_answer_and_nothing_else_is_counted():
    num_symbols, seq_len = 16, 40
    rng = np.random.default_rng(0)
    batch = synthetic.mqar_batch(rng, 64, seq_len, num_symbols=num_symbols, min_len=1, max_len=8)
    half = synthetic.NUM_SPECIAL + num_symbols // 2
    rows = batch["inputs"], batch["targets"], batch["loss_mask"]
    assert (batch["inputs"][:, 0] == BOS).all()
    for inputs, targets, mask in zip(*rows, strict=True):
        n = int(mask.sum())  # one answer per pair
        keys, values = inputs[1 : 2 * n : 2], inputs[2 : 2 * n + 1 : 2]
        assert len(set(keys.tolist())) == n and (keys < half).all() and (values >= half).all()
        pairs = dict(zip(keys.tolist(), values.tolist(), strict=True))
        counted = np.flatnonzero(mask)
        assert (counted >= 2 * n + 1).all()  # each key asked once, after the pairs
        assert sorted(inputs[counted].tolist()) == sorted(keys.tolist())
        for t in counted:
            assert targets[t] == pairs[int(inputs[t])]
        rest = np.setdiff1d(np.arange(2 * n + 1, seq_len), np.concatenate([counted, counted + 1]))
        assert (inputs[rest] == SEP).all()  # the filler around the queries


def test_the_task_and_its_settings():
    data = dict(kind="mqar", seq_len=32, num_symbols=16, min_len=3, max_len=3)
    task = make_task(data)
    assert (task.kind, task.vocab_size) == ("lm", synthetic.symbols_vocab_size(16))
    batch = task.train_batch(seed=1, step=0, batch_size=4)
    np.testing.assert_array_equal(batch["loss_mask"].sum(1), [3, 3, 3, 3])
    again = task.train_batch(seed=1, step=0, batch_size=4)
    np.testing.assert_array_equal(batch["inputs"], again["inputs"])
    assert synthetic.max_len_for("mqar", 32, 16) == 8  # BOS, 8 pairs, 8 queries in 33 tokens
    assert synthetic.max_len_for("mqar", 64, 10) == 5  # distinct keys: half the symbols
    with pytest.raises(DataError, match="data.max_len=9.*data.num_symbols"):
        make_task({**data, "max_len": 9})
