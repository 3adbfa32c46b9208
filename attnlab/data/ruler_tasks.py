"""RULER-style long-context tasks (Hsieh et al. 2024), drawn from any text and any tokenizer.

``make_example(task, rng, length, encode, corpus_lines)`` returns an ``Example``: the prompt
ids (context, question and answer prefix), the reference strings and the ids the answer is
trained on. Every example is a pure function of the generator it is given
(``np.random.default_rng([seed, index, length])`` in ``examples``), so a seed fixes the set.
Prompts are built from pieces encoded separately and concatenated (so any tokenizer counts
them exactly) and take ``length`` tokens with the answer: the haystack is cut at the token
that fills the budget (``cwe``/``fwe`` stop at the last whole word that fits).

Tasks (``TASKS``):

``niah_single``, ``niah_single_essay``, ``niah_single_needles``
    one needle "The magic number for KEY is VALUE." in repeated noise sentences, in lines of
    real text (``corpus_lines``), or among distractor needles with other keys and values.
``niah_single_uuid``
    the same in noise, the value UUID-like hex instead of 7 digits.
``niah_multikey``
    the needle among 3 needles with other keys (in real text); one key is asked.
``niah_multivalue``
    4 needles with one key and 4 values; all 4 are asked.
``niah_multiquery``
    4 needles with 4 keys; all 4 keys are asked.
``vt``
    variable tracking (RULER's default: one chain): ``VAR A = 12345.`` then 4 hops
    ``VAR B = A.`` at sorted depths in noise, asked for every variable that holds the value.
``cwe``, ``fwe``
    common words (3 words 8x more frequent than the rest of a numbered word list) and
    frequent words (3 most frequent of Zipf-distributed coded words), asked for the 3.
``passkey``
    "The pass key is NNNNN. Remember it." in noise.

A prediction scores the fraction of references it contains (RULER's ``string_match_all``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from attnlab.errors import ConfigError

NOISE = (
    "The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ",
    "There and back again. ",
)  # fmt: skip
WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "piano", "maple", "ocean", "candle", "forest",
    "silver", "garden", "rocket", "violet", "harbor", "pepper", "castle", "meadow", "falcon",
    "copper", "lemon", "desert", "island", "winter", "shadow", "breeze", "marble", "willow",
    "canyon", "orchid", "thunder", "saddle", "lantern", "glacier", "cobalt", "sparrow",
    "velvet", "summit", "ember", "quartz", "bamboo", "crystal", "dragon", "feather", "hammer",
    "jungle", "kettle", "ladder", "mirror", "needle", "parrot", "quiver", "ribbon", "spider",
    "tunnel", "walnut", "zephyr", "anchor", "basket", "cactus",
)  # fmt: skip
NUM_ANSWERS = 3  # words asked for by cwe and fwe
HOPS = 4  # variable-tracking chain: the value and 4 hops


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance: ``prompt`` ids (ends with the answer prefix), the ``references``
    a prediction is scored on, and ``target`` (the ids trained on after the prompt)."""

    task: str
    length: int
    prompt: list
    references: tuple
    target: list


def score(prediction: str, references) -> float:
    """The fraction of ``references`` that occur in ``prediction``."""
    return sum(r in prediction for r in references) / len(references)


def _value(rng, kind="digits", taken=()):
    while True:
        if kind == "uuid":
            h = "".join("0123456789abcdef"[i] for i in rng.integers(0, 16, 32))
            v = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        else:
            v = str(int(rng.integers(1_000_000, 10_000_000)))
        if v not in taken:
            return v


def _keys(rng, n):
    return [WORDS[i] for i in rng.choice(len(WORDS), n, replace=False)]


def _needle(key, value):
    return f"The magic number for {key} is {value}. "


def _haystack(rng, kind, corpus_lines, count):
    """An endless supply of haystack sentences (a generator of strings)."""
    if kind == "noise":
        while True:
            yield from NOISE
    elif kind == "essay":
        if not corpus_lines:
            raise ConfigError("an essay haystack needs text lines: pass corpus_lines")
        i = int(rng.integers(0, len(corpus_lines)))
        while True:
            yield corpus_lines[i % len(corpus_lines)] + "\n"
            i += 1
    else:  # needles: distractor needles, none with the asked keys or values
        taken_keys, taken_values = count
        free = [w for w in WORDS if w not in taken_keys]
        while True:
            yield _needle(free[int(rng.integers(0, len(free)))], _value(rng, taken=taken_values))


def _fill(rng, encode, budget, haystack, needles):
    """Haystack ids of exactly ``budget`` tokens with ``needles`` (strings) inserted between
    sentences at uniform depths, every needle whole."""
    needle_ids = [list(encode(n)) for n in needles]
    room = budget - sum(map(len, needle_ids))
    if room < 0:
        raise ConfigError(f"a length of {budget} tokens cannot hold the task's needles")
    sentences, used = [], 0
    while used < room:
        ids = list(encode(next(haystack)))
        sentences.append(ids[: room - used])
        used += len(sentences[-1])
    at = np.sort(rng.integers(0, len(sentences) + 1, len(needles)))
    out = []
    for i, s in enumerate(sentences + [[]]):
        for j in np.nonzero(at == i)[0]:
            out += needle_ids[j]
        out += s
    return out


def _assemble(task, length, encode, context_ids, question, answer, references):
    question_ids, target = list(encode(question)), list(encode(answer))
    prompt = context_ids + question_ids
    return Example(task, length, prompt, tuple(references), target)


def _niah(task, rng, length, encode, lines):
    haystack = {"niah_single": "noise", "niah_single_uuid": "noise", "niah_single_essay": "essay",
                "niah_single_needles": "needles", "niah_multikey": "essay",
                "niah_multivalue": "essay", "niah_multiquery": "essay"}[task]  # fmt: skip
    kind = "uuid" if task == "niah_single_uuid" else "digits"
    n_keys = {"niah_multikey": 4, "niah_multiquery": 4}.get(task, 1)
    keys = _keys(rng, n_keys)
    values = []
    for _ in range(4 if task == "niah_multivalue" else n_keys):
        values.append(_value(rng, kind, taken=values))
    if task == "niah_multivalue":
        needles = [_needle(keys[0], v) for v in values]
        asked, answers = keys[:1], values
        question = f"\nWhat are all the magic numbers for {keys[0]}? They are "
    elif task == "niah_multiquery":
        needles = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
        asked, answers = keys, values
        question = f"\nWhat are the magic numbers for {', '.join(keys)}? They are "
    else:  # one key asked; multikey's other needles are distractors
        needles = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
        asked, answers = keys[:1], values[:1]
        question = f"\nWhat is the magic number for {keys[0]}? The magic number for {keys[0]} is "
    answer = ", ".join(answers) + ".\n"
    question_len = len(encode(question)) + len(encode(answer))
    source = _haystack(rng, haystack, lines, (set(keys), set(values)))
    context = _fill(rng, encode, length - question_len, source, needles)
    del asked
    return _assemble(task, length, encode, context, question, answer, answers)


def _passkey(task, rng, length, encode, lines):
    key = str(int(rng.integers(10_000, 100_000)))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question, answer = "\nWhat is the pass key? The pass key is ", f"{key}.\n"
    budget = length - len(encode(question)) - len(encode(answer))
    context = _fill(rng, encode, budget, _haystack(rng, "noise", lines, None), [needle])
    return _assemble(task, length, encode, context, question, answer, [key])


def _name(rng, taken):
    while True:
        v = "".join(chr(65 + i) for i in rng.integers(0, 26, 3))
        if v not in taken:
            taken.add(v)
            return v


def _vt(task, rng, length, encode, lines):
    taken = set()
    value = str(int(rng.integers(10_000, 100_000)))
    names = [_name(rng, taken) for _ in range(HOPS + 1)]
    statements = [f"VAR {names[0]} = {value}. "]
    statements += [f"VAR {b} = {a}. " for a, b in zip(names[:-1], names[1:], strict=True)]
    question = f"\nWhich variables hold {value}? They are "
    answer = " ".join(names) + ".\n"
    budget = length - len(encode(question)) - len(encode(answer))
    ids = [list(encode(s)) for s in statements]
    room = budget - sum(map(len, ids))
    if room < 0:
        raise ConfigError(f"a length of {length} tokens cannot hold the vt task")
    filler = _fill(rng, encode, room, _haystack(rng, "noise", lines, None), [])
    cut = np.sort(rng.integers(0, len(filler) + 1, len(ids)))
    context, last = [], 0
    for c, s in zip(cut, ids, strict=True):  # the chain in order, at sorted depths
        context += filler[last:c] + s
        last = c
    context += filler[last:]
    return _assemble(task, length, encode, context, question, answer, names)


def _words(rng, length, encode, question, answer_of, counts_of):
    budget_fn = lambda a: length - len(encode(question)) - len(encode(a))  # noqa: E731
    words, counts = counts_of(rng)
    seq = rng.permutation(np.repeat(np.arange(len(words)), counts))
    top = answer_of(words, counts)
    answer = " ".join(top) + ".\n"
    budget = budget_fn(answer) - 8  # the answer's words may change when the list is cut
    context, kept = [], np.zeros(len(words), int)
    for n, i in enumerate(seq):
        piece = list(encode(f"{n + 1}. {words[i]} "))
        if len(context) + len(piece) > budget:
            break
        context += piece
        kept[i] += 1
    order = np.lexsort((np.arange(len(words)), -kept))
    top = [words[i] for i in order[:NUM_ANSWERS]]
    if kept[order[NUM_ANSWERS - 1]] <= kept[order[NUM_ANSWERS]]:
        raise ConfigError(f"a length of {length} tokens is too short for the word tasks")
    return context, top


def _cwe(task, rng, length, encode, lines):
    question = "\nWhat are the 3 most common words above? They are "

    def counts_of(r):
        entry = len(encode("10. candle "))
        slots = max(1, (length - 60) // entry)
        n_rare = max(3, slots // 3)
        words = list(_keys(r, min(len(WORDS), NUM_ANSWERS + n_rare)))
        common = max(3, (slots - (len(words) - NUM_ANSWERS)) // NUM_ANSWERS)
        return words, [common] * NUM_ANSWERS + [1] * (len(words) - NUM_ANSWERS)

    context, top = _words(rng, length, encode, question, lambda w, c: w[:NUM_ANSWERS], counts_of)
    return _assemble(task, length, encode, context, question, " ".join(top) + ".\n", top)


def _fwe(task, rng, length, encode, lines):
    question = "\nWhat are the 3 most frequent coded words above? They are "

    def counts_of(r):
        vocab = ["".join(chr(97 + i) for i in r.integers(0, 26, 5)) for _ in range(40)]
        vocab = list(dict.fromkeys(vocab))
        entry = len(encode("10. abcde "))
        slots = max(8, (length - 70) // entry)
        weights = 1.0 / np.arange(1, len(vocab) + 1) ** 2.0
        counts = np.maximum(1, np.floor(slots * weights / weights.sum())).astype(int)
        counts[:NUM_ANSWERS] += np.arange(NUM_ANSWERS, 0, -1) + 1  # a strict top 3
        return vocab, counts

    context, top = _words(rng, length, encode, question, lambda w, c: w[:NUM_ANSWERS], counts_of)
    return _assemble(task, length, encode, context, question, " ".join(top) + ".\n", top)


TASKS = {
    "niah_single": _niah, "niah_single_uuid": _niah, "niah_single_essay": _niah,
    "niah_single_needles": _niah, "niah_multikey": _niah, "niah_multivalue": _niah,
    "niah_multiquery": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe, "passkey": _passkey,
}  # fmt: skip


def task_names(spec) -> list[str]:
    """``"a,b"`` (or a list; ``"all"``: every task) as checked task names."""
    names = (
        list(TASKS)
        if spec == "all"
        else [t for t in (spec.split(",") if isinstance(spec, str) else spec) if t]
    )
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ConfigError(f"--tasks: unknown task {unknown[:1] or names!r}; use {list(TASKS)}")
    return names


def make_example(task, rng, length, encode, corpus_lines=()) -> Example:
    """One ``Example`` of ``task`` at ``length`` tokens (prompt plus answer)."""
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; use one of {list(TASKS)}")
    return TASKS[task](task, rng, int(length), encode, corpus_lines)


def examples(task, length, n, encode, *, seed=0, corpus_lines=()) -> list[Example]:
    """``n`` examples of ``task`` at ``length``, example ``i`` from ``[seed, i, length]``."""
    return [
        make_example(
            task, np.random.default_rng([seed, i, length, 7]), length, encode, corpus_lines
        )
        for i in range(n)
    ]


def corpus_lines(text: str, min_chars=20, max_chars=120) -> list[str]:
    """The lines of ``text`` worth using as haystack: stripped, of moderate length."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if min_chars <= len(line) <= max_chars]
