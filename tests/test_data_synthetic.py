"""Synthetic tasks: the answers are right, the layout is as documented, MLM rates hold."""

import numpy as np
import pytest

from attnlab.data import synthetic
from attnlab.data.synthetic import BOS, EOS, MASK, NUM_SPECIAL, PAD, SEP

B, T, NUM_SYMBOLS = 64, 40, 12


def _rng(seed=0):
    return np.random.default_rng(seed)


def _rows(batch):
    """Yield (problem, answer, full sequence) for each row of a decoder-only batch."""
    seq_BT = np.concatenate([batch["inputs"][:, :1], batch["targets"]], axis=1)
    for b in range(seq_BT.shape[0]):
        seq = seq_BT[b]
        assert seq[0] == BOS
        sep = int(np.flatnonzero(seq == SEP)[0])
        answer = batch["targets"][b][batch["loss_mask"][b] > 0]
        # The answer follows SEP directly, then EOS, then padding only.
        end = sep + 1 + len(answer)
        np.testing.assert_array_equal(seq[sep + 1 : end], answer)
        assert seq[end] == EOS and np.all(seq[end + 1 :] == PAD)
        yield seq[1:sep], answer, seq


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("copy", lambda p: p), ("reverse", lambda p: p[::-1]), ("sort", np.sort)],
)
def test_sequence_tasks_answers(kind, expected):
    generate = getattr(synthetic, f"{kind}_batch")
    batch = generate(_rng(), B, T, num_symbols=NUM_SYMBOLS, min_len=2, max_len=10)
    lengths = set()
    for problem, answer, _ in _rows(batch):
        lengths.add(len(problem))
        assert 2 <= len(problem) <= 10
        assert np.all((problem >= NUM_SPECIAL) & (problem < NUM_SPECIAL + NUM_SYMBOLS))
        np.testing.assert_array_equal(answer, expected(problem))
    assert len(lengths) > 3  # lengths vary


def test_sequence_tasks_fill_seq_len_at_max_len():
    max_len = synthetic.max_len_for("reverse", T)
    batch = synthetic.reverse_batch(_rng(), 8, T, num_symbols=5, min_len=max_len, max_len=max_len)
    for problem, answer, _ in _rows(batch):
        assert len(problem) == len(answer) == max_len


def test_induction_answer_is_value_of_query_key():
    batch = synthetic.induction_batch(_rng(), B, T, num_symbols=NUM_SYMBOLS, min_len=1, max_len=8)
    for problem, answer, _ in _rows(batch):
        keys, values, query = problem[0:-1:2], problem[1:-1:2], problem[-1]
        assert len(set(keys.tolist())) == len(keys)  # distinct keys
        assert query in keys
        np.testing.assert_array_equal(answer, values[keys == query])


def test_passkey_answer_is_the_hidden_key():
    batch, distance = synthetic.passkey_batch(
        _rng(), B, T, num_symbols=NUM_SYMBOLS, min_len=2, max_len=5, return_distance=True
    )
    filler = (NUM_SPECIAL + NUM_SYMBOLS, NUM_SPECIAL + NUM_SYMBOLS + synthetic.PASSKEY_FILLER)
    seq_BT = np.concatenate([batch["inputs"][:, :1], batch["targets"]], axis=1)
    for b, seq in enumerate(seq_BT):
        hidden, query = np.flatnonzero(seq == SEP)  # the marker appears exactly twice
        assert seq[0] == BOS and query == T - 5 - 1 and query - hidden == distance[b]
        answer_at = np.flatnonzero(batch["loss_mask"][b]) + 1  # target i is seq[i + 1]
        n = len(answer_at)
        assert 2 <= n <= 5
        np.testing.assert_array_equal(answer_at, query + 1 + np.arange(n))
        key = seq[hidden + 1 : hidden + 1 + n]
        assert np.all((key >= NUM_SPECIAL) & (key < NUM_SPECIAL + NUM_SYMBOLS))
        np.testing.assert_array_equal(seq[answer_at], key)
        assert seq[query + n + 1] == EOS and np.all(seq[query + n + 2 :] == PAD)
        rest = np.delete(seq[1:query], np.arange(hidden - 1, hidden + n))
        assert np.all((rest >= filler[0]) & (rest < filler[1]))
    np.testing.assert_array_equal(synthetic.passkey_distances(batch["inputs"]), distance)


def test_passkey_distances_cover_every_offset():
    _, distance = synthetic.passkey_batch(
        _rng(), 4000, T, num_symbols=NUM_SYMBOLS, min_len=4, max_len=4, return_distance=True
    )
    # from the key right before the query (4 + 1) to the key right after BOS
    np.testing.assert_array_equal(np.unique(distance), np.arange(5, T - 4 - 2 + 1))
    with pytest.raises(ValueError, match="two SEP"):
        synthetic.passkey_distances(np.full((2, T), synthetic.PASSKEY_FILLER))


def test_seq2seq_reverse_layout():
    batch = synthetic.seq2seq_reverse_batch(
        _rng(), B, T, num_symbols=NUM_SYMBOLS, min_len=1, max_len=T - 1
    )
    for b in range(B):
        src = batch["src"][b][batch["src_valid"][b]]
        n = len(src)
        out = batch["tgt_out"][b][batch["loss_mask"][b] > 0]
        np.testing.assert_array_equal(out, [*src[::-1], EOS])
        np.testing.assert_array_equal(batch["tgt_in"][b][: n + 1], [BOS, *src[::-1]])
        assert np.all(batch["src"][b][n:] == PAD) and np.all(batch["tgt_out"][b][n + 1 :] == PAD)


def test_addition_sums_are_right():
    batch = synthetic.addition_batch(_rng(), B, T, min_len=1, max_len=6)
    digit_counts = set()
    for b in range(B):
        src = synthetic.decode_addition(batch["src"][b][batch["src_valid"][b]])
        target = synthetic.decode_addition(batch["tgt_out"][b][batch["loss_mask"][b] > 0])
        a, c = src.split("+")
        digit_counts.update([len(a), len(c)])
        assert target == f"{int(a) + int(c)}<eos>"
        assert synthetic.decode_addition(batch["tgt_in"][b]) == f"<bos>{int(a) + int(c)}"
    assert digit_counts == set(range(1, 7))


def test_mlm_corruption_rates():
    num_symbols = 50
    batch = synthetic.mlm_batch(
        _rng(), 1024, 64, num_symbols=num_symbols, min_len=32, max_len=32, mask_rate=0.15
    )
    chosen = batch["loss_mask"] > 0
    assert np.all(batch["valid"]) and not np.any(chosen & ~batch["valid"])
    assert abs(chosen.mean() - 0.15) < 0.01
    inputs, targets = batch["inputs"][chosen], batch["targets"][chosen]
    masked = inputs == MASK
    unchanged = inputs == targets
    replaced = ~masked & ~unchanged
    assert abs(masked.mean() - 0.8) < 0.02
    assert abs(replaced.mean() - 0.1 * (1 - 1 / num_symbols)) < 0.02
    assert abs(unchanged.mean() - 0.1 * (1 + 1 / num_symbols)) < 0.02
    assert np.all(inputs[replaced] >= NUM_SPECIAL)
    np.testing.assert_array_equal(batch["inputs"][~chosen], batch["targets"][~chosen])


def test_mlm_rows_repeat_a_word_and_pad():
    batch = synthetic.mlm_batch(_rng(), B, T, num_symbols=NUM_SYMBOLS, min_len=1, max_len=T // 2)
    for b in range(B):
        n2 = int(batch["valid"][b].sum())
        word = batch["targets"][b][:n2]
        np.testing.assert_array_equal(word[: n2 // 2], word[n2 // 2 :])
        assert np.all(batch["targets"][b][n2:] == PAD)
        assert batch["loss_mask"][b].sum() >= 1


def test_mask_tokens_only_touches_valid_positions():
    ids = np.full((4, 10), 7, np.int32)
    valid = np.arange(10)[None, :] < np.array([[0], [1], [5], [10]])
    out = synthetic.mask_tokens(_rng(), ids, valid, mask_rate=0.15, mask_id=3, low=4, high=9)
    np.testing.assert_array_equal(out["loss_mask"].sum(axis=1), [0, 1, 1, 2])
    assert not np.any((out["loss_mask"] > 0) & ~valid)


def test_same_generator_state_same_batch():
    a = synthetic.sort_batch(_rng(3), 8, T, num_symbols=9, min_len=1, max_len=5)
    b = synthetic.sort_batch(_rng(3), 8, T, num_symbols=9, min_len=1, max_len=5)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize(
    "kind", ["copy", "induction", "passkey", "seq2seq_reverse", "addition", "mlm"]
)
def test_max_len_too_long_is_rejected(kind):
    limit = synthetic.max_len_for(kind, T, NUM_SYMBOLS)
    with pytest.raises(ValueError, match="data.max_len"):
        synthetic.check_lengths(kind, T, NUM_SYMBOLS, 1, limit + 1)
    synthetic.check_lengths(kind, T, NUM_SYMBOLS, 1, limit)


def test_symbol_text_round_trip():
    ids = np.array([BOS, 4, 9, SEP, 9, 4, EOS], np.int32)
    text = synthetic.decode_symbols(ids)
    assert text == "<bos> 0 5 <sep> 5 0 <eos>"
    np.testing.assert_array_equal(synthetic.encode_symbols(text, 6), ids)
    assert synthetic.decode_symbols([4, MASK, 5, PAD], mask=True) == "0 <mask> 1"
    with pytest.raises(ValueError, match="symbol"):
        synthetic.encode_symbols("0 6", 6)


def test_addition_text_round_trip():
    ids = synthetic.encode_addition("<bos>12+305<eos>")
    assert ids[0] == BOS and ids[-1] == EOS and synthetic.PLUS in ids
    assert synthetic.decode_addition(ids) == "<bos>12+305<eos>"
