"""Text tasks: language-model and masked-language-model batches cut from token arrays.

The token arrays (in memory or memory-mapped) feed Grain (``grain_pipeline``): packed
documents with ``data.pipeline="grain"`` (the default; the iterator's state is saved with
each checkpoint), windows read by index with ``"index"`` and for masked language models (a
pure function of (seed, step)). See ``tasks`` for the batch formats.
"""

from __future__ import annotations

import pathlib

import numpy as np

from attnlab.data import fetch, synthetic
from attnlab.data import grain_pipeline as gp
from attnlab.data.corpus import (
    EMBEDDED_DOCUMENTS,
    END_OF_DOCUMENT,
    document_ends,
    load_text,
    split_train_val,
    stdlib_corpus,
    stdlib_documents,
)
from attnlab.data.tasks import EVAL_SEED, EVAL_STREAM, TOKENIZER_FILE, Task, batch_rng, config_field
from attnlab.data.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer
from attnlab.errors import DataError

PIPELINES = ("index", "grain")


def _load_corpus(path, max_chars) -> str:
    if not path:
        return stdlib_corpus(max_chars if max_chars and max_chars > 0 else None)
    if path == EMBEDDED_DOCUMENTS:
        return stdlib_documents(max_chars if max_chars and max_chars > 0 else None)
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
    documents = None
    if config_field(cfg, "path") == EMBEDDED_DOCUMENTS:  # each ended by END_OF_DOCUMENT's id
        documents = document_ends(train, _end_of_document_id(tokenizer))
    return token_task(cfg, name, tokenizer, train, val, mlm=mlm, host=host, documents=documents)


def _end_of_document_id(tokenizer) -> int:
    """The id of ``END_OF_DOCUMENT``: one id of its own (a character or byte tokenizer)."""
    ids = tokenizer.encode(END_OF_DOCUMENT)
    if tokenizer.kind not in ("char", "byte") or len(ids) != 1:
        raise DataError(
            f"data.path={EMBEDDED_DOCUMENTS!r} ends its documents with one character, which "
            f"needs data.tokenizer='char' or 'byte' (got a {tokenizer.kind} tokenizer)"
        )
    return int(ids[0])


def _pipeline(cfg, mlm):
    """``data.pipeline`` and ``data.workers``, checked."""
    pipeline, workers = config_field(cfg, "pipeline"), config_field(cfg, "workers")
    if pipeline not in PIPELINES:
        raise DataError(f"data.pipeline must be one of {PIPELINES}; got {pipeline!r}")
    if not isinstance(workers, int) or workers < 0:
        raise DataError(f"data.workers must be an integer >= 0; got {workers!r}")
    if workers and (mlm or pipeline != "grain"):
        raise DataError(
            "data.workers runs the packed pipeline in worker processes: set data.workers=0 or "
            "use data.kind='text'/'prepared' with data.pipeline='grain'"
        )
    return pipeline, workers


def _train_batches(cfg, train, documents, host, map_fn, mlm):  # mlm: map_fn(rng, rows)
    """Grain's packed batches (``data.pipeline="grain"``, language models) or its windows
    read by index (``"index"``, and masked language models)."""
    pipeline, workers = _pipeline(cfg, mlm)
    seq_len = config_field(cfg, "seq_len")
    if pipeline == "grain" and not mlm:
        ends = np.array([len(train)]) if documents is None else documents

        def packed(seed, batch_size):
            return gp.packed_batches(
                train, ends, seq_len=seq_len, batch_size=batch_size, seed=seed, host=host,
                limit=len(train), workers=workers,
            )  # fmt: skip

        return gp.GrainSampler(packed)
    window = seq_len if mlm else seq_len + 1

    def windows(seed, batch_size):
        return gp.window_batches(
            train, window=window, batch_size=batch_size, seed=seed, host=host,
            **{"random_fn" if mlm else "map_fn": map_fn},
        )  # fmt: skip

    return gp.StepSampler(windows)


def token_task(cfg, name, tokenizer, train, val, *, mlm=False, host=(0, 1), documents=None) -> Task:
    """A text task over token arrays (in memory or memory-mapped), its batches Grain's: packed
    from ``documents`` (their end offsets) with ``data.pipeline="grain"``, else windows read
    by index (``attnlab.data.grain_pipeline``)."""
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

        def evaluate(batch_size, num_batches):
            return gp.spread_batches(
                val, window=window, batch_size=batch_size, num_batches=num_batches,
                map_fn=lambda i, rows: lm(rows),
            )  # fmt: skip

        return Task(
            kind="lm",
            train_batches=_train_batches(cfg, train, documents, host, lm, mlm=False),
            vocab_size=tokenizer.vocab_size,
            eval_batches=evaluate,
            full_eval_batches=lambda B: gp.consecutive_batches(val, seq_len=seq_len, batch_size=B),
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

    def evaluate(batch_size, num_batches):
        return gp.spread_batches(
            val, window=window, batch_size=batch_size, num_batches=num_batches,
            map_fn=lambda i, rows: corrupt(batch_rng(EVAL_SEED, i, EVAL_STREAM), rows),
        )  # fmt: skip

    def decode(ids):
        pieces = np.split(ids, np.flatnonzero(ids == mask_id))
        texts = [tokenizer.decode(p[p != mask_id]) for p in pieces]
        return "[MASK]".join(texts)

    return Task(
        kind="mlm",
        train_batches=_train_batches(cfg, train, documents, host, corrupt, mlm=True),
        vocab_size=mask_id + 1,
        eval_batches=evaluate,
        decode=decode,
        mask_id=mask_id,
        **common,
    )
