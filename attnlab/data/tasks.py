"""Tasks: what a model is trained on, as NumPy batches.

``attnlab.data.make_task(data_cfg)`` reads ``data.kind`` and builds a ``Task``. Synthetic
batches are pure functions of (seed, step): each comes from
``np.random.default_rng([seed, step, stream])`` (no global RNG state). Text batches come from
Grain (``grain_pipeline``): packed documents whose iterator state the run checkpoints, or
windows read by index, again a pure function of (seed, step). Every batch's id fields pass
``validate_ids`` against ``task.vocab_size`` before they are returned. Evaluation batches are
fixed: text tasks read evenly spaced windows of the validation split (the last
``val_fraction`` of the stream); synthetic tasks draw from a fixed evaluation stream that no
training (seed, step) can reach.

Batch formats (ids int32, masks float32, validity bool; B batch, T ``seq_len``, S source len):

``kind == "lm"`` (``text``, ``copy``, ``reverse``, ``sort``, ``induction``, ``mqar``,
``passkey``)
    ``inputs [B, T]``, ``targets [B, T]`` (inputs shifted by one: both are cut from one
    window of T + 1 tokens), ``loss_mask [B, T]`` (1 where the target counts; for text,
    where it continues its input's document, the answer tokens for synthetic tasks). Packed
    text adds ``segment_ids [B, T]`` (1, 2, ... per document in the row, 0 for padding) and
    ``positions [B, T]`` (restarting at 0 in each document).
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

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from attnlab.data import synthetic
from attnlab.data.corpus import DEFAULT_MAX_CHARS
from attnlab.data.tokenizers import validate_ids
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
    "length_task",
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
    "source": "",
    "text_field": "text",
    "pipeline": "grain",
    "workers": 0,
    "tasks": "",
    "reverse_sum": False,
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
        decode: Callable[[np.ndarray], str],
        sample: Callable[[np.random.Generator, int], dict] | None = None,
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
        train_batches: Callable[[int, int, int], dict] | None = None,
    ):
        if kind not in ID_FIELDS:
            raise DataError(f"Task kind must be one of {tuple(ID_FIELDS)}, got {kind!r}")
        self.name, self.kind, self.vocab_size = name, kind, vocab_size
        self.tokenizer = tokenizer
        self.pad_id, self.bos_id, self.eos_id, self.mask_id = pad_id, bos_id, eos_id, mask_id
        self.train_ids, self.val_ids = train_ids, val_ids
        self._sample, self._eval_batches = sample, eval_batches
        self._train_batches = train_batches  # (seed, step, batch_size) -> batch, or sample
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
        if self._train_batches is not None:
            return self._checked(self._train_batches(seed, step, batch_size))
        return self._checked(self._sample(batch_rng(seed, step, TRAIN_STREAM), batch_size))

    def data_state(self) -> dict | None:
        """Where the training pipeline stands (a JSON-able dict, saved with a checkpoint), or
        None where batches are a pure function of (seed, step)."""
        get = getattr(self._train_batches, "get_state", None)
        return None if get is None else get()

    def restore_data_state(self, state: dict | None) -> None:
        """Moves the training pipeline to ``state`` (from ``data_state``); None: nothing."""
        if state is not None and hasattr(self._train_batches, "set_state"):
            self._train_batches.set_state(state)

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
