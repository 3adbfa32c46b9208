"""Text tasks: language-model and masked-language-model batches cut from token arrays.

Windows are read by index from the token arrays (in memory or memory-mapped), so a batch is
a pure function of (seed, step) like every task's (see ``tasks`` for the batch formats).
"""

from __future__ import annotations

import pathlib

import numpy as np

from attnlab.data import fetch, synthetic
from attnlab.data.corpus import load_text, split_train_val, stdlib_corpus
from attnlab.data.tasks import EVAL_SEED, EVAL_STREAM, TOKENIZER_FILE, Task, batch_rng, config_field
from attnlab.data.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer
from attnlab.errors import DataError

PIPELINES = ("index", "grain")


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


def _grain_batches(cfg, train, documents, host):
    """``data.pipeline``: None for the windows read by index, else Grain's packed batches."""
    pipeline = config_field(cfg, "pipeline")
    if pipeline not in PIPELINES:
        raise DataError(f"data.pipeline must be one of {PIPELINES}; got {pipeline!r}")
    if pipeline == "index":
        return None
    from attnlab.data.grain_pipeline import GrainSampler, packed_batches

    ends = np.array([len(train)]) if documents is None else documents
    seq_len = config_field(cfg, "seq_len")

    def make(seed, batch_size):
        return packed_batches(
            train,
            ends,
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            host=host,
            limit=len(train),
        )

    return GrainSampler(make)


def token_task(cfg, name, tokenizer, train, val, *, mlm=False, host=(0, 1), documents=None) -> Task:
    """A text task over token arrays (in memory or memory-mapped); windows are read by index,
    or packed from ``documents`` (their end offsets) by Grain with ``data.pipeline="grain"``."""
    seq_len = config_field(cfg, "seq_len")
    if mlm and config_field(cfg, "pipeline") != "index":
        raise DataError("data.pipeline='grain' packs language-model batches: use data.kind='text'")
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
            train_batches=_grain_batches(cfg, train, documents, host),
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
