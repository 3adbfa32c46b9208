"""``data.kind="length_task"``: train on length-generalisation and RULER-style tasks.

``data.tasks`` names the tasks (comma-separated); every row draws one of them uniformly.

Algorithmic tasks (``ALGORITHMIC``; NoPE's, Kazemnejad et al. 2023) are decoder-only
symbol tasks in ``synthetic``'s format (``BOS problem SEP answer EOS PAD...``, the loss on
the answer), their problem length ``n`` drawn from ``[data.min_len, data.max_len]``:
``copy``, ``reverse``, ``sort`` (``n`` symbols), ``addition`` (two numbers of ``n`` digits,
``+`` between them, the sum most-significant digit first, or least-significant first with
``data.reverse_sum``: the order the carries run in, which small models learn far sooner,
Lee et al. 2023), ``parity`` (``n`` bits, answer their parity) and ``summation`` (``n``
digits, answer their sum mod 10). Digits are
symbols 0-9, ``+`` symbol 10; each problem starts with its task's marker (ids after the
symbols), so one model can learn several; the vocabulary is ``vocab_size(num_symbols)``.

RULER tasks (``ruler_tasks.TASKS``) are text through the run's tokenizer (``data.tokenizer``
built on ``data.path``, the embedded corpus by default, whose lines are also the real-text
haystack): each row is one example of a length drawn uniformly from ``seq_len // 2 + 1``
to ``seq_len + 1`` tokens (the full length where a task needs it), right-padded, the loss
on the answer.
"""

from __future__ import annotations

import numpy as np

from attnlab.data import ruler_tasks, synthetic
from attnlab.data.synthetic import BOS, EOS, NUM_SPECIAL, PAD, SEP
from attnlab.data.tasks import Task, config_field
from attnlab.errors import DataError

PLUS_SYMBOL = 10
ALGORITHMIC = ("copy", "reverse", "sort", "addition", "parity", "summation")


def vocab_size(num_symbols: int) -> int:
    """Specials, the symbols (at least digits and ``+``), then one marker per task."""
    return NUM_SPECIAL + max(int(num_symbols), PLUS_SYMBOL + 1) + len(ALGORITHMIC)


def row_len(task: str, n: int) -> int:
    """Tokens of one row of ``task`` at problem length ``n`` (BOS marker problem SEP answer
    EOS)."""
    problem, answer = {
        "addition": (2 * n + 1, n + 1),
        "parity": (n, 1),
        "summation": (n, 1),
    }.get(task, (n, n))
    return problem + answer + 4


def _rows(problems, answers, seq_len):
    """``BOS problem SEP answer EOS`` per row, padded to ``seq_len + 1``; the LM batch."""
    B = len(problems)
    seq = np.full((B, seq_len + 1), PAD, np.int32)
    mask = np.zeros((B, seq_len + 1), np.float32)
    for b, (p, a) in enumerate(zip(problems, answers, strict=True)):
        row = [BOS, *p, SEP, *a, EOS]
        if len(row) > seq_len + 1:
            raise DataError(f"a row of {len(row)} tokens does not fit data.seq_len={seq_len}")
        seq[b, : len(row)] = row
        mask[b, len(p) + 2 : len(row)] = 1.0  # the answer and EOS, as targets
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "loss_mask": mask[:, 1:]}


def _instance(task, rng, n, num_symbols, reverse_sum=False):
    """``(problem symbols, answer symbols)`` of one ``task`` row at problem length ``n``."""
    if task in ("copy", "reverse", "sort"):
        x = rng.integers(0, num_symbols, n)
        return x, {"copy": x, "reverse": x[::-1], "sort": np.sort(x)}[task]
    if task == "addition":
        d = rng.integers(0, 10, (2, n))
        d[:, 0] = rng.integers(1 if n > 1 else 0, 10, 2)  # no leading zero
        a, b = (int("".join(map(str, row))) for row in d)
        total = list(map(int, str(a + b)))[:: -1 if reverse_sum else 1]
        return [*map(int, str(a)), PLUS_SYMBOL, *map(int, str(b))], total
    x = rng.integers(0, 2 if task == "parity" else 10, n)
    return x, [int(x.sum() % (2 if task == "parity" else 10))]


def algorithmic_batch(tasks, rng, batch_size, seq_len, *, num_symbols, min_len, max_len,
                      reverse_sum=False):  # fmt: skip
    """A batch of ``tasks`` (a name or a list: each row draws one), problem lengths uniform
    in ``[min_len, max_len]``; each problem starts with its task's marker symbol."""
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    for task in tasks:
        if task not in ALGORITHMIC:
            raise DataError(f"data.tasks: unknown task {task!r}; use {list(ALGORITHMIC)}")
        if not 1 <= min_len <= max_len or row_len(task, max_len) > seq_len + 1:
            raise DataError(
                f"data.min_len={min_len}, data.max_len={max_len}: need 1 <= min_len <= max_len "
                f"and a {task} row of max_len ({row_len(task, max_len)} tokens) within "
                "data.seq_len + 1"
            )
    marker = vocab_size(num_symbols) - len(ALGORITHMIC)
    problems, answers = [], []
    for _ in range(batch_size):
        task = tasks[int(rng.integers(0, len(tasks)))]
        n = int(rng.integers(min_len, max_len + 1))
        x, a = _instance(task, rng, n, num_symbols, reverse_sum)
        problems.append([marker + ALGORITHMIC.index(task), *(NUM_SPECIAL + int(s) for s in x)])
        answers.append([NUM_SPECIAL + int(s) for s in a])
    return _rows(problems, answers, seq_len)


def ruler_batch(names, rng, batch_size, seq_len, encode, lines):
    """Rows of RULER-style examples of up to ``seq_len + 1`` tokens, the loss on the answer."""
    seq = np.zeros((batch_size, seq_len + 1), np.int32)
    mask = np.zeros((batch_size, seq_len + 1), np.float32)
    for b in range(batch_size):
        task = names[int(rng.integers(0, len(names)))]
        n = int(rng.integers(seq_len // 2 + 1, seq_len + 2))
        try:
            ex = ruler_tasks.make_example(task, rng, n, encode, lines)
        except Exception:  # too short for this task: the full length
            ex = ruler_tasks.make_example(task, rng, seq_len + 1, encode, lines)
        row = ex.prompt + ex.target
        seq[b, : len(row)] = row[: seq_len + 1]
        mask[b, len(ex.prompt) : len(row)] = 1.0
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "loss_mask": mask[:, 1:]}


def task_list(cfg) -> list[str]:
    spec = config_field(cfg, "tasks")
    names = [t for t in str(spec).split(",") if t]
    if not names:
        raise DataError("data.kind='length_task' needs data.tasks, e.g. --config.data.tasks=copy")
    known = (*ALGORITHMIC, *ruler_tasks.TASKS)
    unknown = [t for t in names if t not in known]
    if unknown:
        raise DataError(f"data.tasks: unknown task {unknown[0]!r}; use one of {list(known)}")
    if {n in ALGORITHMIC for n in names} == {True, False}:
        raise DataError("data.tasks: mix algorithmic and RULER tasks in separate runs")
    return names


def length_task(cfg, workdir, host=(0, 1)) -> Task:
    """The ``Task`` of ``data.kind="length_task"``."""
    names, seq_len = task_list(cfg), int(config_field(cfg, "seq_len"))
    if names[0] in ALGORITHMIC:
        num_symbols = int(config_field(cfg, "num_symbols"))
        min_len = int(config_field(cfg, "min_len"))
        reverse_sum = bool(config_field(cfg, "reverse_sum"))
        max_len = int(config_field(cfg, "max_len")) or max(
            n for n in range(1, seq_len) if all(row_len(t, n) <= seq_len + 1 for t in names)
        )

        def sample(rng, batch_size):
            return algorithmic_batch(
                names,
                rng,
                batch_size,
                seq_len,
                num_symbols=num_symbols,
                min_len=min_len,
                max_len=max_len,
                reverse_sum=reverse_sum,
            )

        sample(np.random.default_rng(0), 1)  # the settings, checked now
        V = vocab_size(num_symbols)
        return Task(
            name="length_task",
            kind="lm",
            vocab_size=V,
            sample=sample,
            decode=lambda ids: synthetic.decode_symbols(ids),
            encode=lambda text: synthetic.encode_symbols(text, V - NUM_SPECIAL),
            pad_id=PAD,
            bos_id=BOS,
            eos_id=EOS,
        )
    from attnlab.data.text import _load_corpus, _text_tokenizer

    text = _load_corpus(config_field(cfg, "path"), config_field(cfg, "max_chars"))
    tokenizer = _text_tokenizer(
        config_field(cfg, "tokenizer"), text, workdir, config_field(cfg, "vocab_size")
    )
    lines = ruler_tasks.corpus_lines(text)

    def encode(s):
        return [int(i) for i in tokenizer.encode(s)]

    for t in names:  # each task fits the row and the tokenizer knows its text
        try:
            ruler_tasks.make_example(t, np.random.default_rng(0), seq_len + 1, encode, lines)
        except Exception as e:
            raise DataError(f"data.tasks: {t} at data.seq_len={seq_len}: {e}") from None

    def sample(rng, batch_size):
        return ruler_batch(names, rng, batch_size, seq_len, encode, lines)

    return Task(
        name="length_task",
        kind="lm",
        vocab_size=tokenizer.vocab_size,
        sample=sample,
        decode=lambda ids: tokenizer.decode(np.asarray(ids)),
        encode=tokenizer.encode,
        tokenizer=tokenizer,
    )


def teacher_forced_accuracy(predict, task, n, *, rows, seq_len, num_symbols, seed=0,
                            per_token=False, reverse_sum=False) -> float:  # fmt: skip
    """Exact-match accuracy of ``predict(inputs) -> argmax ids`` on ``rows`` fresh rows of
    ``task`` at problem length ``n`` (a row counts when every answer token is the argmax:
    what greedy decoding would write); with ``per_token``, the fraction of answer tokens
    (EOS included) that are the argmax."""
    rng = np.random.default_rng([seed, n, 9])
    batch = algorithmic_batch(
        task, rng, rows, seq_len, num_symbols=num_symbols, min_len=n, max_len=n,
        reverse_sum=reverse_sum,
    )  # fmt: skip
    hit = np.asarray(predict(batch["inputs"])) == batch["targets"]
    mask = batch["loss_mask"] > 0
    if per_token:
        return float((hit & mask).sum() / mask.sum())
    return float(((hit | ~mask).all(axis=1)).mean())
