"""RULER-style and algorithmic length tasks: deterministic by seed, the answer where it should
be, the scorer and the effective length on hand-made outputs, a copying model at 1.0 and a
silent one at 0.0, and ``data.kind="length_task"`` batches."""

import json

import numpy as np
import pytest

from attnlab.data import length_tasks, make_task, ruler_tasks
from attnlab.data.corpus import stdlib_corpus
from attnlab.data.synthetic import NUM_SPECIAL, SEP
from attnlab.data.tokenizers import ByteTokenizer
from attnlab.errors import ConfigError, DataError
from attnlab.evaluation import ruler

TOK = ByteTokenizer()
LINES = ruler_tasks.corpus_lines(stdlib_corpus(60_000))
FITS = {t: 1024 if t == "fwe" else 400 for t in ruler_tasks.TASKS}


def _encode(text):
    return [int(i) for i in TOK.encode(text)]


def _decode(ids):
    return TOK.decode(np.asarray(ids))


def _examples(task, n=3, seed=0):
    return ruler_tasks.examples(task, FITS[task], n, _encode, seed=seed, corpus_lines=LINES)


@pytest.mark.parametrize("task", list(ruler_tasks.TASKS))
def test_each_task_is_deterministic_by_seed_and_fits_its_length(task):
    a, b, c = _examples(task), _examples(task), _examples(task, seed=1)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    assert [e.references for e in a] == [e.references for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]
    for e in a:
        total = len(e.prompt) + len(e.target)
        exact = task not in ("cwe", "fwe")  # word lists stop at the last whole word
        assert total == FITS[task] if exact else FITS[task] - 40 <= total <= FITS[task]
        answer = _decode(e.target)
        assert all(r in answer for r in e.references)


@pytest.mark.parametrize(
    "task", ["niah_single", "niah_single_uuid", "niah_single_essay", "niah_single_needles",
             "niah_multikey", "niah_multivalue", "niah_multiquery"],
)  # fmt: skip
def test_each_needle_value_is_in_the_context_exactly_once(task):
    for e in _examples(task, n=4):
        text = _decode(e.prompt)
        for value in e.references:
            assert text.count(value) == 1
            assert f" is {value}. " in text  # inside its needle


def test_passkey_vt_and_word_tasks_hold_their_answers():
    for e in _examples("passkey"):
        text = _decode(e.prompt)
        assert text.count(f"The pass key is {e.references[0]}.") == 1
    for e in _examples("vt"):
        text = _decode(e.prompt)
        first, *hops = e.references
        assert text.count(f"VAR {first} = ") == 1
        for a, b in zip(e.references, hops, strict=False):
            assert text.count(f"VAR {b} = {a}. ") == 1
    for task in ("cwe", "fwe"):
        for e in _examples(task):
            words = _decode(e.prompt).split("\n")[0].split()[1::2]
            counts = {w: words.count(w) for w in set(words)}
            top = sorted(counts.values(), reverse=True)
            assert min(counts[w] for w in e.references) >= top[len(e.references) - 1]
            assert min(counts[w] for w in e.references) > top[len(e.references)]


def test_the_scorer_on_hand_made_outputs():
    assert ruler_tasks.score("1234567.", ("1234567",)) == 1.0
    assert ruler_tasks.score("7654321", ("1234567",)) == 0.0
    assert ruler_tasks.score("11, 22", ("11", "22", "33", "44")) == 0.5
    table = {"a": {"8": 1.0, "16": 0.9, "32": 0.5}, "b": {"8": 1.0, "16": 0.85, "32": None}}
    assert ruler.effective_length(table, [8, 16, 32], 0.856) == 16
    assert ruler.effective_length(table, [8, 16, 32], 0.95) == 8
    assert ruler.effective_length({"a": {"8": 0.1}}, [8], 0.856) is None


@pytest.mark.parametrize("task", ["niah_single", "niah_multivalue", "vt", "cwe", "passkey"])
def test_a_model_that_copies_the_answer_scores_one_and_a_silent_one_zero(task):
    examples = _examples(task, n=4)
    answer_of = {tuple(e.prompt): e.target for e in examples}

    def copying(prompts, max_new_tokens):
        return [answer_of[tuple(p)][:max_new_tokens] for p in prompts]

    def silent(prompts, max_new_tokens):
        return [_encode("I do not know.\n") for _ in prompts]

    assert ruler.task_accuracy(copying, _decode, examples)[0] == 1.0
    assert ruler.task_accuracy(silent, _decode, examples)[0] == 0.0


def test_unknown_tasks_and_short_lengths_are_errors():
    with pytest.raises(ConfigError, match="unknown task"):
        ruler_tasks.task_names("niah_single,nope")
    assert ruler_tasks.task_names("all") == list(ruler_tasks.TASKS)
    with pytest.raises(ConfigError, match="cannot hold"):
        ruler_tasks.make_example("niah_multiquery", np.random.default_rng(0), 64, _encode)


@pytest.mark.parametrize("task", length_tasks.ALGORITHMIC)
def test_algorithmic_rows_hold_the_right_answer(task):
    rng = np.random.default_rng(0)
    batch = length_tasks.algorithmic_batch(task, rng, 16, 40, num_symbols=16, min_len=1, max_len=8)
    marker = length_tasks.vocab_size(16) - len(length_tasks.ALGORITHMIC)
    for inputs, targets, mask in zip(batch["inputs"], batch["targets"], batch["loss_mask"],
                                     strict=True):  # fmt: skip
        row = list(inputs)
        sep = row.index(SEP)
        assert row[1] == marker + length_tasks.ALGORITHMIC.index(task)
        x = [i - NUM_SPECIAL for i in row[2:sep]]
        answer = [t - NUM_SPECIAL for t in targets[mask > 0]][:-1]  # without EOS
        if task == "copy":
            want = x
        elif task == "reverse":
            want = x[::-1]
        elif task == "sort":
            want = sorted(x)
        elif task == "addition":
            plus = x.index(length_tasks.PLUS_SYMBOL)
            a, b = (int("".join(map(str, part))) for part in (x[:plus], x[plus + 1 :]))
            want = list(map(int, str(a + b)))
        elif task == "parity":
            want = [sum(x) % 2]
        else:
            want = [sum(x) % 10]
        assert answer == want


def _assert_sums_least_significant_first(batch):
    """Each addition row's answer is the sum's digits from the units up (Python's integers)."""
    for row, targets, mask in zip(batch["inputs"], batch["targets"], batch["loss_mask"],
                                  strict=True):  # fmt: skip
        x = [int(i) - NUM_SPECIAL for i in row[2 : list(row).index(SEP)]]
        plus = x.index(length_tasks.PLUS_SYMBOL)
        total = int("".join(map(str, x[:plus]))) + int("".join(map(str, x[plus + 1 :])))
        answer = [int(t) - NUM_SPECIAL for t in targets[mask > 0]][:-1]  # without EOS
        assert answer == [total // 10**k % 10 for k in range(len(str(total)))]


def test_reverse_sum_writes_the_sum_least_significant_digit_first():
    options = dict(num_symbols=16, min_len=3, max_len=9)
    plain = length_tasks.algorithmic_batch("addition", np.random.default_rng(1), 32, 40, **options)
    flipped = length_tasks.algorithmic_batch(
        "addition", np.random.default_rng(1), 32, 40, reverse_sum=True, **options
    )
    _assert_sums_least_significant_first(flipped)
    # The same draws: the problems (up to SEP) and the answer positions agree.
    problem = np.cumsum(plain["inputs"] == SEP, axis=1) == 0
    np.testing.assert_array_equal(plain["inputs"][problem], flipped["inputs"][problem])
    np.testing.assert_array_equal(plain["loss_mask"], flipped["loss_mask"])
    assert (plain["targets"] != flipped["targets"]).any()
    # And the data kind hands the field on.
    task = make_task({"kind": "length_task", "tasks": "addition", "seq_len": 24,
                      "min_len": 2, "max_len": 5, "reverse_sum": True})  # fmt: skip
    _assert_sums_least_significant_first(task.train_batch(0, 0, 16))


def test_the_data_kind_builds_both_families():
    task = make_task({"kind": "length_task", "tasks": "copy,parity", "seq_len": 24,
                      "num_symbols": 8, "min_len": 1, "max_len": 6})  # fmt: skip
    batch = task.train_batch(0, 0, 4)
    assert batch["inputs"].shape == (4, 24) and batch["loss_mask"].sum() > 0
    np.testing.assert_array_equal(batch["inputs"], task.train_batch(0, 0, 4)["inputs"])
    text = make_task({"kind": "length_task", "tasks": "niah_single,passkey", "seq_len": 160,
                      "tokenizer": "byte", "max_chars": 30_000})  # fmt: skip
    batch = text.train_batch(0, 1, 2)
    assert batch["inputs"].shape == (2, 160)
    answer = text.decode(batch["targets"][0][batch["loss_mask"][0] > 0])
    assert answer.rstrip("\n").rstrip(".").isdigit()
    with pytest.raises(DataError, match="data.tasks"):
        make_task({"kind": "length_task", "tasks": "", "seq_len": 16})
    with pytest.raises(DataError, match="separate runs"):
        make_task({"kind": "length_task", "tasks": "copy,passkey", "seq_len": 160})


@pytest.mark.slow(reason="imports the harness, trains a tiny run and decodes its tasks")
def test_the_task_folder_runs_in_the_harness(tiny_lm_run, tmp_path):
    from attnlab.evaluation import ruler_harness
    from attnlab.evaluation.backends import from_run
    from attnlab.evaluation.harness import run_harness

    pytest.importorskip("lm_eval")
    names = ruler_harness.write_tasks(tmp_path, "passkey", [160], _encode, _decode, examples=2)
    assert names == ["ruler_passkey_160"]
    rows = [json.loads(line) for line in (tmp_path / "passkey_160.jsonl").read_text().split("\n")
            if line]  # fmt: skip
    assert all(r["outputs"][0] in r["input"] for r in rows)
    out = run_harness(from_run(tiny_lm_run), ruler_harness.TAG, include_path=tmp_path,
                      bootstrap_iters=0)  # fmt: skip
    assert 0.0 <= out["results"]["ruler_passkey_160"]["recall,none"] <= 1.0
