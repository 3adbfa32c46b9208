"""Tasks: what a model is trained on, as NumPy batches that are pure functions of (seed, step).

``attnlab.data.make_task(data_cfg)`` reads ``data.kind`` and builds a ``Task``. Every batch
comes from ``np.random.default_rng([seed, step, stream])`` (no global RNG state), and its id
fields pass ``validate_ids`` against ``task.vocab_size`` before they are returned. Evaluation
batches are
fixed: text tasks read evenly spaced windows of the validation split (the last
``val_fraction`` of the stream); synthetic tasks draw from a fixed evaluation stream that no
training (seed, step) can reach.

Batch formats (ids int32, masks float32, validity bool; B batch, T ``seq_len``, S source len):

``kind == "lm"`` (``text``, ``copy``, ``reverse``, ``sort``, ``induction``, ``mqar``,
``passkey``)
    ``inputs [B, T]``, ``targets [B, T]`` (inputs shifted by one: both are cut from one
    window of T + 1 tokens), ``loss_mask [B, T]`` (1 where the target counts; all ones for
    text, the answer tokens for synthetic tasks).
``kind == "seq2seq"`` (``seq2seq_reverse``, ``addition``)
    ``src [B, S]``, ``src_valid [B, S]``, ``tgt_in [B, T]`` (BOS, answer, PAD...),
    ``tgt_out [B, T]`` (answer, EOS, PAD...), ``loss_mask [B, T]`` (answer and EOS); S = T.
``kind == "mlm"`` (``mlm``, ``mlm_text``)
    ``inputs [B, T]`` (corrupted: of the chosen ~``mask_rate`` of valid positions 80% are the
    mask id, 10% a random id, 10% unchanged), ``targets [B, T]`` (original ids),
    ``loss_mask [B, T]`` (1 at the chosen positions), ``valid [B, T]``.

Synthetic tasks reserve ids ``PAD=0, BOS=1, EOS=2`` and 3 (SEP, or MASK in ``mlm``). Text
tasks use the tokenizer's ids; ``mlm_text`` adds one mask id after them.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from attnlab.data import fetch, synthetic
from attnlab.data.corpus import DEFAULT_MAX_CHARS, load_text, split_train_val, stdlib_corpus
from attnlab.data.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer, validate_ids
from attnlab.errors import DataError, DecodeError, TokenIdError, one_line

TASK_KINDS = (
    "text",
    "copy",
    "reverse",
    "sort",
    "induction",
    "mqar",
    "passkey",
    "seq2seq_reverse",
    "addition",
    "mlm",
    "mlm_text",
    "prepared",
)
TOKENIZER_FILE = "tokenizer.json"
TRAIN_STREAM, EVAL_STREAM = 0, 1
EVAL_SEED = 0
ID_FIELDS = {
    "lm": ("inputs", "targets"),
    "seq2seq": ("src", "tgt_in", "tgt_out"),
    "mlm": ("inputs", "targets"),
}

_DEFAULTS = {
    "kind": "text",
    "path": "",
    "tokenizer": "char",
    "seq_len": 128,
    "val_fraction": 0.1,
    "num_symbols": 16,
    "min_len": 1,
    "max_len": 0,
    "mask_rate": 0.15,
    "max_chars": DEFAULT_MAX_CHARS,
    "vocab_size": 0,
}


def batch_rng(seed: int, step: int, stream: int = TRAIN_STREAM) -> np.random.Generator:
    """The generator for one batch: a pure function of (seed, step, stream)."""
    if min(seed, step, stream) < 0:
        raise DataError(f"seed, step and stream must be >= 0, got {seed}, {step}, {stream}")
    return np.random.default_rng([int(seed), int(step), int(stream)])


class Task:
    """A batch source with its vocabulary; build one with ``make_task``."""

    def __init__(
        self,
        *,
        name: str,
        kind: str,
        vocab_size: int,
        sample: Callable[[np.random.Generator, int], dict],
        decode: Callable[[np.ndarray], str],
        eval_batches: Callable[[int, int], list[dict]] | None = None,
        full_eval_batches: Callable[[int], Iterator[dict]] | None = None,
        encode: Callable[[str], np.ndarray] | None = None,
        tokenizer=None,
        pad_id: int | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        mask_id: int | None = None,
        train_ids: np.ndarray | None = None,
        val_ids: np.ndarray | None = None,
    ):
        if kind not in ID_FIELDS:
            raise DataError(f"Task kind must be one of {tuple(ID_FIELDS)}, got {kind!r}")
        self.name, self.kind, self.vocab_size = name, kind, vocab_size
        self.tokenizer = tokenizer
        self.pad_id, self.bos_id, self.eos_id, self.mask_id = pad_id, bos_id, eos_id, mask_id
        self.train_ids, self.val_ids = train_ids, val_ids
        self._sample, self._eval_batches = sample, eval_batches
        self._full_eval_batches = full_eval_batches
        self._decode, self._encode = decode, encode

    def _checked(self, batch: dict) -> dict:
        """``batch`` after checking its ids (an id past the vocabulary would make the loss
        NaN, or clamp silently, instead of failing)."""
        for field in ID_FIELDS[self.kind]:
            try:
                validate_ids(batch[field], self.vocab_size, name=f"{self.name} batch[{field!r}]")
            except DecodeError as e:
                raise TokenIdError(
                    f"{one_line(e)}: the data holds ids its tokenizer does not have (for "
                    "data.kind='prepared', tokens.bin was written with another tokenizer); "
                    "rewrite it with `attnlab data prepare` or set data.tokenizer to the one "
                    "that wrote it"
                ) from None
        return batch

    def train_batch(self, seed: int, step: int, batch_size: int) -> dict:
        return self._checked(self._sample(batch_rng(seed, step, TRAIN_STREAM), batch_size))

    def eval_batches(self, batch_size: int, num_batches: int) -> list[dict]:
        """The same ``num_batches`` batches on every call."""
        if self._eval_batches is not None:
            batches = self._eval_batches(batch_size, num_batches)
        else:
            batches = [
                self._sample(batch_rng(EVAL_SEED, i, EVAL_STREAM), batch_size)
                for i in range(num_batches)
            ]
        return [self._checked(b) for b in batches]

    def full_eval_batches(self, batch_size: int) -> Iterator[dict]:
        """Every token of the validation split, once: consecutive non-overlapping windows
        of the model's context, the shorter tail included (its padding and the rows that
        fill the last batch carry ``loss_mask`` 0), in batches of ``batch_size`` rows."""
        if self._full_eval_batches is None:
            raise DataError(
                f"data.kind={self.name!r} has no fixed validation split to evaluate in full: "
                "--full is for language-model runs on text (data.kind=text, prepared or a "
                "cache: corpus); leave out --full to use the run's eval.batches"
            )
        for batch in self._full_eval_batches(batch_size):
            yield self._checked(batch)

    def decode(self, ids) -> str:
        return self._decode(np.asarray(ids))

    def encode(self, text: str) -> np.ndarray:
        if self._encode is None:
            raise DataError(f"data.kind={self.name!r} has no text encoding")
        return self._encode(text)

    def describe(self, batch: dict, row: int = 0) -> str:
        """One example of ``batch`` as readable lines."""
        if self.kind == "seq2seq":
            keep = batch["loss_mask"][row] > 0
            return (
                f"src:    {self.decode(batch['src'][row][batch['src_valid'][row]])}\n"
                f"target: {self.decode(batch['tgt_out'][row][keep])}"
            )
        if self.kind == "mlm":
            valid = batch["valid"][row]
            chosen = batch["loss_mask"][row][valid] > 0
            return (
                f"inputs:  {self.decode(batch['inputs'][row][valid])}\n"
                f"targets: {self.decode(batch['targets'][row][valid][chosen])}"
            )
        keep = batch["loss_mask"][row] > 0
        text = f"inputs:  {self.decode(batch['inputs'][row])}"
        if not keep.all():
            text += f"\nanswer:  {self.decode(batch['targets'][row][keep])}"
        return text

    def __repr__(self):
        return f"Task(name={self.name!r}, kind={self.kind!r}, vocab_size={self.vocab_size})"


def config_field(cfg, name):
    value = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
    return _DEFAULTS[name] if value is None else value


def _load_corpus(path, max_chars) -> str:
    if not path:
        return stdlib_corpus(max_chars if max_chars and max_chars > 0 else None)
    text = load_text(fetch.resolve(path))
    return text[:max_chars] if max_chars and max_chars > 0 else text


def _text_tokenizer(name, text, workdir, vocab_size=0):
    """The tokenizer for a text task, kept in ``workdir/tokenizer.json`` for resuming.

    ``name``: "char" (the corpus's characters), "byte", "bpe" (a byte-level BPE of
    ``vocab_size`` ids trained on the corpus) or the path of a ``tokenizer.json``.
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        build, kind = (lambda: CharTokenizer.from_text(text)), "char"
    elif name == "bpe":
        from attnlab.data.bpe import train_bpe

        build, kind = (lambda: train_bpe(text, int(vocab_size) or 1024)), "bpe"
    elif name.endswith(".json") or pathlib.Path(name).is_file():
        build, kind = (lambda: load_tokenizer(name)), None
    else:
        raise DataError(
            f"data.tokenizer must be 'char', 'byte', 'bpe' or a tokenizer.json path, got {name!r}"
        )
    if workdir is None:
        try:
            return build()
        except DataError:  # a tokenizer file that cannot be read names itself
            raise
        except ValueError as e:
            raise DataError(f"data.path: {e}; use a non-empty text") from None
    path = pathlib.Path(workdir) / TOKENIZER_FILE
    if path.exists():
        tokenizer = load_tokenizer(path)
        if kind is not None and tokenizer.kind != kind:
            raise DataError(
                f"{path} holds a {tokenizer.kind} tokenizer but data.tokenizer={name!r}"
            )
        return tokenizer
    tokenizer = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path)
    return tokenizer


def host_rows(batch_size: int, host=(0, 1)) -> slice:
    """The rows of a global batch that process ``host[0]`` of ``host[1]`` reads."""
    index, count = host
    if batch_size % count:
        raise ValueError(f"train.batch_size={batch_size} must divide over {count} processes")
    per = batch_size // count
    return slice(index * per, (index + 1) * per)


def _windows(ids, starts, length):
    return ids[np.asarray(starts)[:, None] + np.arange(length)[None, :]].astype(np.int32)


def _consecutive_windows(ids, seq_len, batch_size):
    """LM batches over all of ``ids``: window ``i`` predicts ``ids[i*T+1 : (i+1)*T+1]`` from
    the tokens before each, so every token after the first is a target exactly once."""
    n_targets = len(ids) - 1
    starts = np.arange(0, n_targets, seq_len)
    for first in range(0, len(starts), batch_size):
        rows = starts[first : first + batch_size]
        inputs = np.zeros((batch_size, seq_len), np.int32)
        targets = np.zeros((batch_size, seq_len), np.int32)
        loss_mask = np.zeros((batch_size, seq_len), np.float32)
        for r, s in enumerate(rows):
            n = min(seq_len, n_targets - s)
            inputs[r, :n] = ids[s : s + n]
            targets[r, :n] = ids[s + 1 : s + n + 1]
            loss_mask[r, :n] = 1.0
        yield {"inputs": inputs, "targets": targets, "loss_mask": loss_mask}


def _spread_starts(ids, length, count):
    """``count`` window starts spread evenly over ``ids``."""
    return np.rint(np.linspace(0, len(ids) - length, count)).astype(np.int64)


def text_task(cfg, workdir, mlm, host=(0, 1)):
    name = config_field(cfg, "kind")
    text = _load_corpus(config_field(cfg, "path"), config_field(cfg, "max_chars"))
    tokenizer = _text_tokenizer(
        config_field(cfg, "tokenizer"), text, workdir, config_field(cfg, "vocab_size")
    )
    try:
        ids = tokenizer.encode(text)
    except ValueError as err:
        where = f" (vocabulary loaded from {pathlib.Path(workdir) / TOKENIZER_FILE})"
        raise DataError(f"data.path: {err}{where if workdir is not None else ''}") from err
    train, val = split_train_val(ids, config_field(cfg, "val_fraction"))
    return token_task(cfg, name, tokenizer, train, val, mlm=mlm, host=host)


def token_task(cfg, name, tokenizer, train, val, *, mlm=False, host=(0, 1)) -> Task:
    """A text task over token arrays (in memory or memory-mapped); windows are read by index."""
    seq_len = config_field(cfg, "seq_len")
    window = seq_len if mlm else seq_len + 1
    for split, part in (("train", train), ("validation", val)):
        if len(part) < window:
            raise DataError(
                f"the {split} split has {len(part)} tokens, fewer than one window of {window} "
                f"(data.seq_len={seq_len}, data.val_fraction={config_field(cfg, 'val_fraction')}): "
                "use a longer text, a smaller --config.data.seq_len or another "
                "--config.data.val_fraction"
            )
    common = dict(name=name, tokenizer=tokenizer, encode=tokenizer.encode)
    common.update(train_ids=train, val_ids=val)

    if not mlm:

        def lm(window_ids):
            ones = np.ones((len(window_ids), seq_len), np.float32)
            return {"inputs": window_ids[:, :-1], "targets": window_ids[:, 1:], "loss_mask": ones}

        def sample(rng, batch_size):
            starts = rng.integers(0, len(train) - seq_len, batch_size)[host_rows(batch_size, host)]
            return lm(_windows(train, starts, window))

        def evaluate(batch_size, num_batches):
            starts = _spread_starts(val, window, batch_size * num_batches)
            return [lm(_windows(val, s, window)) for s in np.split(starts, num_batches)]

        def evaluate_all(batch_size):
            yield from _consecutive_windows(val, seq_len, batch_size)

        return Task(
            kind="lm",
            vocab_size=tokenizer.vocab_size,
            sample=sample,
            eval_batches=evaluate,
            full_eval_batches=evaluate_all,
            decode=tokenizer.decode,
            **common,
        )

    mask_id = tokenizer.vocab_size
    mask_rate = config_field(cfg, "mask_rate")

    def corrupt(rng, window_ids):
        valid = np.ones(window_ids.shape, bool)
        return synthetic.mask_tokens(
            rng, window_ids, valid, mask_rate=mask_rate, mask_id=mask_id, low=0, high=mask_id
        )

    def sample(rng, batch_size):
        return corrupt(
            rng, _windows(train, rng.integers(0, len(train) - seq_len + 1, batch_size), window)
        )

    def evaluate(batch_size, num_batches):
        starts = _spread_starts(val, window, batch_size * num_batches)
        return [
            corrupt(batch_rng(EVAL_SEED, i, EVAL_STREAM), _windows(val, s, window))
            for i, s in enumerate(np.split(starts, num_batches))
        ]

    def decode(ids):
        pieces = np.split(ids, np.flatnonzero(ids == mask_id))
        texts = [tokenizer.decode(p[p != mask_id]) for p in pieces]
        return "[MASK]".join(texts)

    return Task(
        kind="mlm",
        vocab_size=mask_id + 1,
        sample=sample,
        eval_batches=evaluate,
        decode=decode,
        mask_id=mask_id,
        **common,
    )


_GENERATORS = {
    "copy": synthetic.copy_batch,
    "reverse": synthetic.reverse_batch,
    "sort": synthetic.sort_batch,
    "induction": synthetic.induction_batch,
    "mqar": synthetic.mqar_batch,
    "passkey": synthetic.passkey_batch,
    "seq2seq_reverse": synthetic.seq2seq_reverse_batch,
    "addition": synthetic.addition_batch,
    "mlm": synthetic.mlm_batch,
}


def synthetic_task(cfg):
    name, seq_len = config_field(cfg, "kind"), config_field(cfg, "seq_len")
    num_symbols = 10 if name == "addition" else config_field(cfg, "num_symbols")
    min_len = config_field(cfg, "min_len")
    max_len = config_field(cfg, "max_len") or synthetic.max_len_for(name, seq_len, num_symbols)
    synthetic.check_lengths(name, seq_len, num_symbols, min_len, max_len)
    options = {"min_len": min_len, "max_len": max_len}
    if name != "addition":
        options["num_symbols"] = num_symbols
    if name == "mlm":
        options["mask_rate"] = config_field(cfg, "mask_rate")
    generate = _GENERATORS[name]

    def sample(rng, batch_size):
        return generate(rng, batch_size, seq_len, **options)

    if name == "addition":
        vocab_size = synthetic.ADDITION_VOCAB_SIZE
        decode, encode = synthetic.decode_addition, synthetic.encode_addition
    else:
        # passkey: the filler ids follow the key alphabet and read as symbols after it
        symbols = num_symbols + (synthetic.PASSKEY_FILLER if name == "passkey" else 0)
        vocab_size = synthetic.symbols_vocab_size(symbols)

        def decode(ids):
            return synthetic.decode_symbols(ids, mask=name == "mlm")

        def encode(text):
            return synthetic.encode_symbols(text, symbols)

    if name == "mlm":
        kind, special = "mlm", {"mask_id": synthetic.MASK}
    else:
        kind = "seq2seq" if name in synthetic.SEQ2SEQ_TASKS else "lm"
        special = {"bos_id": synthetic.BOS, "eos_id": synthetic.EOS}
    return Task(
        name=name,
        kind=kind,
        vocab_size=vocab_size,
        sample=sample,
        decode=decode,
        encode=encode,
        pad_id=synthetic.PAD,
        **special,
    )
