"""Synthetic tasks generated on the fly, one batch at a time from a NumPy ``Generator``.

Ids 0..3 are reserved: ``PAD=0``, ``BOS=1``, ``EOS=2`` and id 3, which is ``SEP`` in the
decoder-only tasks and ``MASK`` in masked LM. Content symbols follow from id 4.

* Decoder-only (``copy``, ``reverse``, ``sort``, ``induction``, ``passkey``): one sequence
  ``BOS problem SEP answer EOS PAD...`` of length ``seq_len + 1``, split into inputs and
  targets shifted by one; ``loss_mask`` is 1 exactly where the target is an answer token.
  ``induction`` is associative recall: the problem is key/value pairs (distinct keys) and then
  one of the keys; the answer is the value paired with it.
* ``mqar`` is multi-query associative recall (Zoology, Arora et al. 2023): ``BOS k1 v1 ...
  kn vn`` (distinct keys from the first half of the symbols, values from the second half),
  then every key once more in a random order, each followed by its value, at uniformly
  drawn places in SEP filler that fills the row to ``seq_len``; ``loss_mask`` is 1 on the
  recalled values alone. The problem length is the number of pairs, so a longer
  ``seq_len`` with the same pairs moves the queries further from their keys.
* ``passkey`` is long-context retrieval: ``BOS filler SEP key filler SEP key EOS``, the key
  (the problem length) hidden after the first SEP at a random depth in filler drawn from
  ``PASSKEY_FILLER`` ids that follow the key alphabet; the second SEP, which closes the
  problem, asks for it. Rows fill ``seq_len`` and the distance between the two SEPs is uniform
  over every value that fits (``passkey_distances`` reads it back from a batch).
* Encoder-decoder (``seq2seq_reverse``, ``addition``): ``src`` is the problem, the target is
  ``BOS answer`` in, ``answer EOS`` out. Addition writes numbers most-significant digit first
  with a ``+`` symbol between them.
* Encoder-only (``mlm``): a random word written twice (so a masked symbol can be recovered
  from its other copy), corrupted by ``mask_tokens``.

Problem lengths are drawn uniformly from ``[min_len, max_len]``; ``max_len_for`` gives the
largest ``max_len`` that fits ``seq_len``. Render ids with ``decode_symbols`` /
``decode_addition``; ``encode_symbols`` / ``encode_addition`` read that text back.
"""

from __future__ import annotations

import re

import numpy as np

from attnlab.errors import DataError

PAD, BOS, EOS, SEP, MASK = 0, 1, 2, 3, 3
NUM_SPECIAL = 4
PLUS = NUM_SPECIAL + 10  # addition: digits 0-9 are ids 4..13, '+' is 14
ADDITION_VOCAB_SIZE = NUM_SPECIAL + 11
DECODER_TASKS = ("copy", "reverse", "sort", "induction", "mqar", "passkey")
PASSKEY_FILLER = 8  # filler ids of the passkey task, after the key alphabet
SEQ2SEQ_TASKS = ("seq2seq_reverse", "addition")


def symbols_vocab_size(num_symbols: int) -> int:
    return NUM_SPECIAL + num_symbols


def max_len_for(kind: str, seq_len: int, num_symbols: int | None = None) -> int:
    """The largest problem length (pairs for ``induction``, digits for ``addition``) that fits."""
    if kind in ("copy", "reverse", "sort"):
        return (seq_len - 2) // 2  # BOS n SEP n EOS in seq_len + 1
    if kind == "induction":
        return min((seq_len - 4) // 2, num_symbols)  # BOS 2n+1 SEP 1 EOS; distinct keys
    if kind == "mqar":
        return min(seq_len // 4, num_symbols // 2)  # BOS 2n pairs 2n queries in seq_len + 1
    if kind == "passkey":
        return (seq_len - 3) // 2  # BOS SEP n SEP n EOS in seq_len + 1, no filler
    if kind == "seq2seq_reverse":
        return seq_len - 1  # BOS n / n EOS
    if kind == "addition":
        return (seq_len - 1) // 2  # n + n in the source
    if kind == "mlm":
        return seq_len // 2
    raise DataError(f"no synthetic task named {kind!r}")


def check_lengths(kind, seq_len, num_symbols, min_len, max_len):
    """Raise a ValueError naming the config field when the problem lengths cannot work."""
    if kind != "addition" and num_symbols < 2:
        raise DataError(f"data.num_symbols must be >= 2 for {kind}, got {num_symbols}")
    limit = max_len_for(kind, seq_len, num_symbols)
    if limit < 1:
        raise DataError(f"data.seq_len={seq_len} is too short for the {kind} task")
    if not 1 <= min_len <= max_len:
        raise DataError(f"need 1 <= data.min_len <= data.max_len, got {min_len}, {max_len}")
    if max_len > limit:
        extra = " and data.num_symbols" if kind in ("induction", "mqar") else ""
        raise DataError(
            f"data.max_len={max_len} does not fit the {kind} task with data.seq_len={seq_len}"
            f"{extra}: at most {limit}"
        )


def _lengths(rng, batch_size, min_len, max_len):
    return rng.integers(min_len, max_len + 1, size=batch_size)


def _symbols(rng, shape, num_symbols):
    return rng.integers(NUM_SPECIAL, NUM_SPECIAL + num_symbols, size=shape)


def _reverse_prefix(x_BP, n_B):
    """Reverse the first ``n`` entries of every row (the rest is junk)."""
    idx_BP = n_B[:, None] - 1 - np.arange(x_BP.shape[1])[None, :]
    return np.take_along_axis(x_BP, np.maximum(idx_BP, 0), axis=1)


def _scatter_rows(out, row_start_B, x_BP, n_B):
    """out[b, row_start[b] + j] = x[b, j] for j < n[b]."""
    b, j = np.nonzero(np.arange(x_BP.shape[1])[None, :] < n_B[:, None])
    out[b, row_start_B[b] + j] = x_BP[b, j]
    return b, row_start_B[b] + j


def pack_lm(problem_BP, problem_len_B, answer_BA, answer_len_B, seq_len):
    """``BOS problem SEP answer EOS PAD...`` as an LM batch with the loss on the answer."""
    B = problem_BP.shape[0]
    rows = np.arange(B)
    if np.any(problem_len_B + answer_len_B + 3 > seq_len + 1):
        raise DataError("pack_lm: problem and answer do not fit seq_len")
    seq = np.full((B, seq_len + 1), PAD, np.int32)
    answer_mask = np.zeros((B, seq_len + 1), bool)
    seq[:, 0] = BOS
    _scatter_rows(seq, np.ones(B, np.int64), problem_BP, problem_len_B)
    seq[rows, problem_len_B + 1] = SEP
    answer_at = _scatter_rows(seq, problem_len_B + 2, answer_BA, answer_len_B)
    answer_mask[answer_at] = True
    seq[rows, problem_len_B + answer_len_B + 2] = EOS
    return {
        "inputs": seq[:, :-1],
        "targets": seq[:, 1:],
        "loss_mask": answer_mask[:, 1:].astype(np.float32),
    }


def _sequence_task(kind, rng, batch_size, seq_len, num_symbols, min_len, max_len):
    check_lengths(kind, seq_len, num_symbols, min_len, max_len)
    x_BP = _symbols(rng, (batch_size, max_len), num_symbols)
    n_B = _lengths(rng, batch_size, min_len, max_len)
    if kind == "copy":
        answer_BP = x_BP
    elif kind == "reverse":
        answer_BP = _reverse_prefix(x_BP, n_B)
    else:
        valid_BP = np.arange(max_len)[None, :] < n_B[:, None]
        answer_BP = np.sort(np.where(valid_BP, x_BP, np.iinfo(np.int32).max), axis=1)
    return pack_lm(x_BP, n_B, answer_BP, n_B, seq_len)


def copy_batch(rng, batch_size, seq_len, *, num_symbols, min_len, max_len):
    """Answer = the problem."""
    return _sequence_task("copy", rng, batch_size, seq_len, num_symbols, min_len, max_len)


def reverse_batch(rng, batch_size, seq_len, *, num_symbols, min_len, max_len):
    """Answer = the problem reversed."""
    return _sequence_task("reverse", rng, batch_size, seq_len, num_symbols, min_len, max_len)


def sort_batch(rng, batch_size, seq_len, *, num_symbols, min_len, max_len):
    """Answer = the problem sorted ascending."""
    return _sequence_task("sort", rng, batch_size, seq_len, num_symbols, min_len, max_len)


def induction_batch(rng, batch_size, seq_len, *, num_symbols, min_len, max_len):
    """Problem ``k1 v1 ... kn vn q`` with distinct keys; answer = the value paired with q."""
    check_lengths("induction", seq_len, num_symbols, min_len, max_len)
    B, rows = batch_size, np.arange(batch_size)
    keys_BP = np.argsort(rng.random((B, num_symbols)), axis=1)[:, :max_len] + NUM_SPECIAL
    values_BP = _symbols(rng, (B, max_len), num_symbols)
    n_B = _lengths(rng, B, min_len, max_len)
    query_B = rng.integers(0, n_B)
    problem = np.zeros((B, 2 * max_len + 1), np.int64)
    problem[:, 0 : 2 * max_len : 2] = keys_BP
    problem[:, 1 : 2 * max_len : 2] = values_BP
    problem[rows, 2 * n_B] = keys_BP[rows, query_B]
    answer = values_BP[rows, query_B][:, None]
    return pack_lm(problem, 2 * n_B + 1, answer, np.ones(B, np.int64), seq_len)


def mqar_rows(keys_BP, values_BP, order_BP, starts_BP, n_B, seq_len):
    """MQAR rows from their parts (``mqar_batch`` draws them): pairs ``j < n_B[b]`` of
    ``keys_BP``/``values_BP`` after BOS, then query ``i`` (pair ``order_BP[b, i]``, its key
    and value) at offset ``starts_BP[b, i]`` of the SEP-filled rest; the loss on the values."""
    B = keys_BP.shape[0]
    seq = np.full((B, seq_len + 1), SEP, np.int32)
    seq[:, 0] = BOS
    answer = np.zeros((B, seq_len + 1), bool)
    b, j = np.nonzero(np.arange(keys_BP.shape[1])[None, :] < n_B[:, None])
    seq[b, 1 + 2 * j], seq[b, 2 + 2 * j] = keys_BP[b, j], values_BP[b, j]
    pair = order_BP[b, j]
    at = 1 + 2 * n_B[b] + starts_BP[b, j]
    if np.any(at + 1 > seq_len) or np.any(pair >= n_B[b]):
        raise DataError("mqar_rows: a query lies past seq_len or names a missing pair")
    seq[b, at], seq[b, at + 1] = keys_BP[b, pair], values_BP[b, pair]
    answer[b, at + 1] = True
    return {
        "inputs": seq[:, :-1],
        "targets": seq[:, 1:],
        "loss_mask": answer[:, 1:].astype(np.float32),
    }


def mqar_batch(rng, batch_size, seq_len, *, num_symbols, min_len, max_len):
    """Multi-query associative recall: ``min_len..max_len`` key/value pairs, every key queried
    once after them; keys are the first ``num_symbols // 2`` symbols, values the rest."""
    check_lengths("mqar", seq_len, num_symbols, min_len, max_len)
    B, half = batch_size, num_symbols // 2
    keys_BP = np.argsort(rng.random((B, half)), axis=1)[:, :max_len] + NUM_SPECIAL
    values_BP = _symbols(rng, (B, max_len), num_symbols - half) + half
    n_B = _lengths(rng, B, min_len, max_len)
    missing_BP = np.arange(max_len)[None, :] >= n_B[:, None]
    order_BP = np.argsort(np.where(missing_BP, np.inf, rng.random((B, max_len))), axis=1)
    # Query i starts at c_i + i, for n distinct sorted c_i among (filler + n) places.
    places_B = seq_len - 4 * n_B + n_B
    draws = np.where(
        np.arange(seq_len)[None, :] < places_B[:, None], rng.random((B, seq_len)), np.inf
    )
    chosen_BP = np.argsort(draws, axis=1)[:, :max_len]
    chosen_BP = np.sort(np.where(missing_BP, seq_len, chosen_BP), axis=1)
    starts_BP = chosen_BP + np.arange(max_len)[None, :]
    return mqar_rows(keys_BP, values_BP, order_BP, starts_BP, n_B, seq_len)


def passkey_batch(
    rng, batch_size, seq_len, *, num_symbols, min_len, max_len, return_distance=False
):
    """``BOS filler SEP key filler SEP key EOS``: the answer is the key hidden after the first SEP.

    Keys are ``min_len..max_len`` symbols; the second SEP sits at ``seq_len - max_len - 1``
    (rows with shorter keys end in PAD) and the first one ``distance`` tokens before it,
    uniform over ``[n + 1, seq_len - max_len - 2]`` for a key of ``n`` symbols: from the key
    right before the query to the key right after BOS. ``distance`` is also the offset between
    each key symbol and its copy in the answer. With ``return_distance`` the result is
    ``(batch, distance_B)``.
    """
    check_lengths("passkey", seq_len, num_symbols, min_len, max_len)
    B, rows = batch_size, np.arange(batch_size)
    n_B = _lengths(rng, B, min_len, max_len)
    key_BP = _symbols(rng, (B, max_len), num_symbols)
    query = seq_len - max_len - 1  # the second SEP (pack_lm puts it after the problem)
    distance_B = rng.integers(n_B + 1, query)
    filler = NUM_SPECIAL + num_symbols + rng.integers(0, PASSKEY_FILLER, size=(B, query - 1))
    hidden_B = query - distance_B - 1  # the first SEP, as an index of the problem
    filler[rows, hidden_B] = SEP
    _scatter_rows(filler, hidden_B + 1, key_BP, n_B)
    batch = pack_lm(filler, np.full(B, query - 1), key_BP, n_B, seq_len)
    return (batch, distance_B) if return_distance else batch


def passkey_distances(inputs_BT) -> np.ndarray:
    """``[B]`` distance between the two SEPs of each passkey row: how far back its key is hidden."""
    inputs_BT = np.asarray(inputs_BT)
    b, t = np.nonzero(inputs_BT == SEP)
    if not np.array_equal(np.bincount(b, minlength=len(inputs_BT)), np.full(len(inputs_BT), 2)):
        raise DataError("passkey_distances: every row needs exactly two SEP tokens")
    return t[1::2] - t[0::2]


def _seq2seq(src_BP, src_len_B, tgt_BP, tgt_len_B, seq_len):
    """src padded to seq_len; ``BOS tgt`` in, ``tgt EOS`` out, loss on tgt and EOS."""
    B, rows = src_BP.shape[0], np.arange(src_BP.shape[0])
    positions = np.arange(seq_len)[None, :]
    src = np.full((B, seq_len), PAD, np.int32)
    _scatter_rows(src, np.zeros(B, np.int64), src_BP, src_len_B)
    tgt_in = np.full((B, seq_len), PAD, np.int32)
    tgt_in[:, 0] = BOS
    _scatter_rows(tgt_in, np.ones(B, np.int64), tgt_BP, tgt_len_B)
    tgt_out = np.full((B, seq_len), PAD, np.int32)
    _scatter_rows(tgt_out, np.zeros(B, np.int64), tgt_BP, tgt_len_B)
    tgt_out[rows, tgt_len_B] = EOS
    return {
        "src": src,
        "src_valid": positions < src_len_B[:, None],
        "tgt_in": tgt_in,
        "tgt_out": tgt_out,
        "loss_mask": (positions <= tgt_len_B[:, None]).astype(np.float32),
    }


def seq2seq_reverse_batch(rng, batch_size, seq_len, *, num_symbols, min_len, max_len):
    """Encoder-decoder reversal: src = symbols, target = the symbols reversed."""
    check_lengths("seq2seq_reverse", seq_len, num_symbols, min_len, max_len)
    x_BP = _symbols(rng, (batch_size, max_len), num_symbols)
    n_B = _lengths(rng, batch_size, min_len, max_len)
    return _seq2seq(x_BP, n_B, _reverse_prefix(x_BP, n_B), n_B, seq_len)


def _digits(number: int) -> list[int]:
    return [NUM_SPECIAL + int(c) for c in str(number)]


def addition_batch(rng, batch_size, seq_len, *, min_len, max_len):
    """src = ``a + b`` (each ``min_len..max_len`` digits, no leading zero), target = the sum."""
    check_lengths("addition", seq_len, 10, min_len, max_len)
    digits_B2P = rng.integers(0, 10, size=(batch_size, 2, max_len))
    digits_B2P[:, :, 0] = rng.integers(1, 10, size=(batch_size, 2))
    len_B2 = rng.integers(min_len, max_len + 1, size=(batch_size, 2))
    src_BP = np.full((batch_size, 2 * max_len + 1), PAD, np.int64)
    tgt_BP = np.full((batch_size, max_len + 1), PAD, np.int64)
    src_len, tgt_len = np.zeros(batch_size, np.int64), np.zeros(batch_size, np.int64)
    for b in range(batch_size):
        a, c = (int("".join(map(str, digits_B2P[b, i, : len_B2[b, i]]))) for i in range(2))
        src = [*_digits(a), PLUS, *_digits(c)]
        tgt = _digits(a + c)
        src_BP[b, : len(src)], src_len[b] = src, len(src)
        tgt_BP[b, : len(tgt)], tgt_len[b] = tgt, len(tgt)
    return _seq2seq(src_BP, src_len, tgt_BP, tgt_len, seq_len)


def mask_tokens(rng, ids_BT, valid_BT, *, mask_rate, mask_id, low, high):
    """BERT corruption of the valid positions of ``ids_BT``.

    ``round(mask_rate * n_valid)`` positions per row (at least one) are chosen; of those 80%
    become ``mask_id``, 10% a random id in ``[low, high)`` and 10% stay unchanged.
    """
    if not 0.0 < mask_rate <= 1.0:
        raise DataError(f"data.mask_rate must be in (0, 1], got {mask_rate}")
    ids_BT = np.asarray(ids_BT, np.int32)
    valid_BT = np.asarray(valid_BT, bool)
    n_valid_B = valid_BT.sum(axis=1)
    k_B = np.where(n_valid_B > 0, np.maximum(1, np.rint(mask_rate * n_valid_B)), 0)
    keys_BT = np.where(valid_BT, rng.random(ids_BT.shape), np.inf)
    rank_BT = np.argsort(np.argsort(keys_BT, axis=1), axis=1)
    chosen_BT = rank_BT < k_B[:, None]
    u_BT = rng.random(ids_BT.shape)
    random_BT = rng.integers(low, high, size=ids_BT.shape)
    inputs = np.where(chosen_BT & (u_BT < 0.8), mask_id, ids_BT)
    inputs = np.where(chosen_BT & (u_BT >= 0.8) & (u_BT < 0.9), random_BT, inputs)
    return {
        "inputs": inputs.astype(np.int32),
        "targets": ids_BT,
        "loss_mask": chosen_BT.astype(np.float32),
        "valid": valid_BT,
    }


def mlm_batch(rng, batch_size, seq_len, *, num_symbols, min_len, max_len, mask_rate=0.15):
    """A random word of ``min_len..max_len`` symbols written twice, padded, then masked."""
    check_lengths("mlm", seq_len, num_symbols, min_len, max_len)
    word_BP = _symbols(rng, (batch_size, max_len), num_symbols)
    n_B = _lengths(rng, batch_size, min_len, max_len)
    ids = np.full((batch_size, seq_len), PAD, np.int32)
    _scatter_rows(ids, np.zeros(batch_size, np.int64), word_BP, n_B)
    _scatter_rows(ids, n_B, word_BP, n_B)
    valid = np.arange(seq_len)[None, :] < 2 * n_B[:, None]
    return mask_tokens(
        rng,
        ids,
        valid,
        mask_rate=mask_rate,
        mask_id=MASK,
        low=NUM_SPECIAL,
        high=NUM_SPECIAL + num_symbols,
    )


_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>"}


def decode_symbols(ids, *, mask=False, keep_pad=False) -> str:
    """``<bos> 3 0 7 <sep> 7 0 3 <eos>``: symbols as their index, id 3 as <sep> or <mask>."""
    names = {**_NAMES, 3: "<mask>" if mask else "<sep>"}
    ids = np.atleast_1d(np.asarray(ids)).tolist()
    return " ".join(names.get(i, str(i - NUM_SPECIAL)) for i in ids if keep_pad or i != PAD)


def encode_symbols(text: str, num_symbols: int) -> np.ndarray:
    """Inverse of ``decode_symbols`` (both ``<sep>`` and ``<mask>`` read as id 3)."""
    names = {**{v: k for k, v in _NAMES.items()}, "<sep>": SEP, "<mask>": MASK}
    ids = []
    for word in text.split():
        if word in names:
            ids.append(names[word])
        elif word.isdigit() and int(word) < num_symbols:
            ids.append(NUM_SPECIAL + int(word))
        else:
            raise DataError(
                f"{word!r} is neither a special token nor a symbol 0..{num_symbols - 1}"
            )
    return np.array(ids, np.int32)


def decode_addition(ids, *, keep_pad=False) -> str:
    """``<bos>12+34<eos>``: digits and '+' as themselves, specials in angle brackets."""
    names = {**_NAMES, 3: "<sep>", PLUS: "+"}
    ids = np.atleast_1d(np.asarray(ids)).tolist()
    return "".join(names.get(i, str(i - NUM_SPECIAL)) for i in ids if keep_pad or i != PAD)


def encode_addition(text: str) -> np.ndarray:
    """Inverse of ``decode_addition``; whitespace is ignored."""
    names = {**{v: k for k, v in _NAMES.items()}, "<sep>": SEP, "+": PLUS}
    ids = []
    for token in re.findall(r"<[a-z]+>|\S", text):
        if token in names:
            ids.append(names[token])
        elif token.isdigit():
            ids.append(NUM_SPECIAL + int(token))
        else:
            raise DataError(f"addition text may hold only digits, '+' and <bos>/<eos>: {token!r}")
    return np.array(ids, np.int32)
