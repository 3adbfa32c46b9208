"""The input pipeline: every text batch comes from Grain (``data.pipeline``).

``"grain"`` (the default): packed language-model batches from a corpus's documents, every
stage Grain's own:

1. a ``MapDataset`` over the training split's documents (``documents.npy``), each cut into
   chunks of at most ``seq_len + 1`` tokens, read by index from the memory-mapped
   ``tokens.bin`` (only the chunks a batch needs are read);
2. a global shuffle of the chunks, deterministic per seed and different in every epoch
   (``shuffle`` then ``repeat``);
3. sharding by process: process ``i`` of ``n`` reads every ``n``-th chunk of the shuffled
   order (``ds[i::n]``), so the processes see disjoint chunks;
4. first-fit packing into rows of ``seq_len + 1`` tokens with per-document segment ids
   and positions (``FirstFitPackIterDataset``);
5. batching (``batch``), rows per process = ``batch_size / n``;
6. a thread that keeps ``PREFETCH`` batches ready (``ThreadPrefetchIterDataset``), or with
   ``data.workers > 0`` that many worker processes (``mp_prefetch``).

Each row gives ``inputs``/``targets`` (the row without its last/first token),
``segment_ids`` (1, 2, ... per document in the row, 0 for padding; the model attends within
a segment only), ``positions`` (restarting at 0 in each document) and ``loss_mask``
(1 where the target continues the input's document). The iterator's state
(``iterator.get_state()``) is a small dict: ``save_state``/``restore_state`` write and read
it with Orbax, so a pipeline resumes at the batch where it stopped, bitwise; with several
processes each writes its own (``save_process_state``).

``"index"`` (and masked-language-model text, which is not packed): windows of the token
stream at every offset, globally shuffled per seed, sharded by process and batched by a
Grain ``MapDataset``; batch ``step`` is ``dataset[step]``, a pure function of
(seed, step), so there is no state to save. Evaluation batches are ``MapDataset`` reads too.
"""

from __future__ import annotations

import pathlib

import numpy as np

PACKING_BINS = 16  # rows packed at a time: more bins, less padding, more reordering
# Batches a background thread keeps ready. None by default: packing a batch takes a few
# milliseconds, a percent or two of a step, and a thread gained nothing measurable on the
# 2-core machine (docs/data.md); data.workers moves the pipeline to worker processes.
PREFETCH = 0
# Threads reading chunks ahead of the packer. The reads are cheap slices of a memory map, so
# on a small machine the threads' hand-offs cost more than they save (2 shared cores: 9,400
# chunks/s with none, 5,600 with one, 3,400 with two).
READ_THREADS = 0
MAX_OFFSETS = 1 << 31  # window offsets shuffled at most; longer streams use every k-th
STATE_DIR = "data_state"  # per-process iterator states of a multi-process run's checkpoints


def _grain():
    from attnlab.errors import optional_import

    return optional_import("grain", None, "text data (data.kind, data.pipeline)")


def rows_per_process(batch_size: int, count: int) -> int:
    """The rows of each global batch one of ``count`` processes reads."""
    if batch_size % count:
        raise ValueError(f"train.batch_size={batch_size} must divide over {count} processes")
    return batch_size // count


def window_batches(
    tokens, *, window: int, batch_size: int, seed: int, host=(0, 1), map_fn=None, random_fn=None
):
    """The Grain ``MapDataset`` of this process's batches of ``window``-token rows of
    ``tokens`` at every offset: a global shuffle per seed (new in each epoch), every ``n``-th
    window for process ``i`` of ``n``, ``batch_size / n`` rows a batch, then ``map_fn(rows)``
    or ``random_fn(rng, rows)``. Batch ``step`` is ``dataset[step]``."""
    grain = _grain()
    index, count = host
    per = rows_per_process(batch_size, count)
    offsets = len(tokens) - window + 1
    stride = -(-offsets // MAX_OFFSETS)  # Grain's index shuffle takes 32-bit indices
    ds = grain.MapDataset.range(0, offsets, stride).shuffle(seed=seed).repeat()[index::count]
    ds = ds.map(lambda start: np.asarray(tokens[start : start + window], np.int32))
    ds = ds.batch(per, drop_remainder=True)
    if random_fn is not None:  # a generator per (seed, batch index): a pure function of both
        ds = ds.random_map(lambda rows, rng: random_fn(rng, rows), seed=seed)
    return ds if map_fn is None else ds.map(map_fn)


def spread_batches(tokens, *, window: int, batch_size: int, num_batches: int, map_fn) -> list:
    """``num_batches`` batches of ``window``-token rows at offsets spread evenly over
    ``tokens`` (the same on every call), ``map_fn(i, rows)`` applied to batch ``i``."""
    grain = _grain()
    count = batch_size * num_batches
    starts = np.rint(np.linspace(0, len(tokens) - window, count)).astype(np.int64)
    ds = grain.MapDataset.source(starts)
    ds = ds.map(lambda start: np.asarray(tokens[start : start + window], np.int32))
    ds = ds.batch(batch_size)
    return [map_fn(i, ds[i]) for i in range(len(ds))]  # by index: no reading threads


def consecutive_batches(ids, *, seq_len: int, batch_size: int):
    """LM batches over all of ``ids`` (read from a Grain ``MapDataset``): row ``i`` predicts
    ``ids[i*T+1 : (i+1)*T+1]`` from the tokens before each, so every token after the first
    is a target exactly once; the tail row's padding and the rows that fill the last batch
    carry ``loss_mask`` 0."""
    n_targets = len(ids) - 1

    def row(start):
        n = min(seq_len, n_targets - start)
        out = {k: np.zeros(seq_len, np.int32) for k in ("inputs", "targets")}
        out["inputs"][:n] = ids[start : start + n]
        out["targets"][:n] = ids[start + 1 : start + n + 1]
        out["loss_mask"] = (np.arange(seq_len) < n).astype(np.float32)
        return out

    def fill(rows):  # the last batch is topped up with empty rows to keep its shape
        rows = rows + [{k: np.zeros_like(v) for k, v in rows[0].items()}] * (batch_size - len(rows))
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    ds = _grain().MapDataset.range(0, n_targets, seq_len).map(row)
    ds = ds.batch(batch_size, batch_fn=fill)
    return (ds[i] for i in range(len(ds)))  # by index, as needed: no reading threads


class DocumentChunks:
    """The documents ending at ``ends`` cut into chunks of at most ``length`` tokens,
    documents cut at ``limit`` (the end of the training split); chunks of one token (no
    target) are dropped. ``chunks[i]`` is the ``(start, end)`` of chunk ``i``, found from
    per-document arrays: memory grows with the documents, never with the chunks (a 6 GiB
    corpus of one document is 50 million chunks).
    """

    def __init__(self, ends, length: int, limit: int | None = None):
        ends = np.asarray(ends, np.int64)
        starts = np.concatenate([[0], ends[:-1]])
        if limit is not None:
            keep = starts < limit
            starts, ends = starts[keep], np.minimum(ends[keep], limit)
        # Chunks of two tokens or more: the whole windows, and the last one when it holds two.
        counts = np.maximum(-(-(ends - starts - 1) // length), 0)
        self.starts, self.ends, self.length = starts, ends, length
        self.first = np.cumsum(counts) - counts  # each document's first chunk
        self.total = int(counts.sum())

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> tuple[int, int]:
        doc = int(np.searchsorted(self.first, i, side="right")) - 1
        start = int(self.starts[doc] + (i - self.first[doc]) * self.length)
        return start, min(start + self.length, int(self.ends[doc]))


def lm_fields(row: dict) -> dict:
    """The language-model batch of packed rows ``ids``, ``ids_segment_ids``,
    ``ids_positions`` ``[B, T + 1]``."""
    ids, seg, pos = row["ids"], row["ids_segment_ids"], row["ids_positions"]
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return {
        "inputs": ids[:, :-1].astype(np.int32),
        "targets": ids[:, 1:].astype(np.int32),
        "loss_mask": same.astype(np.float32),
        "segment_ids": seg[:, :-1].astype(np.int32),
        "positions": pos[:, :-1].astype(np.int32),
    }


def packed_batches(
    tokens,
    ends,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    host=(0, 1),
    limit: int | None = None,
    bins: int = PACKING_BINS,
    prefetch: int = PREFETCH,
    read_threads: int = READ_THREADS,
    workers: int = 0,
):
    """The Grain ``IterDataset`` of this process's packed batches (see the module's text)."""
    grain = _grain()
    index, count = host
    per = rows_per_process(batch_size, count)
    window = seq_len + 1
    chunks = DocumentChunks(ends, window, limit)
    if len(chunks) < count:
        raise ValueError(f"the corpus has {len(chunks)} chunks, fewer than {count} processes")

    def read(i):
        start, end = chunks[i]
        return {"ids": np.asarray(tokens[start:end], np.int32)}

    ds = grain.MapDataset.range(len(chunks)).shuffle(seed=seed)[index::count]
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * read_threads)
    ds = ds.repeat().map(read).to_iter_dataset(options)
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"ids": window}, num_packing_bins=bins, seed=seed
    )
    ds = ds.batch(per, drop_remainder=True).map(lm_fields)
    if workers:  # worker processes run the whole pipeline, each on a slice of it
        from absl import flags

        if not flags.FLAGS.is_parsed():  # Grain's workers read its flags (defaults here)
            flags.FLAGS.mark_as_parsed()
        return ds.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=workers))
    if prefetch:  # a thread reads ahead while the step runs
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return ds


def save_state(directory, iterator) -> None:
    """Writes ``iterator.get_state()`` to ``directory`` with Orbax (JSON)."""
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckpt:
        ckpt.save(pathlib.Path(directory).absolute(), iterator.get_state(), force=True)


def restore_state(directory, iterator):
    """``iterator`` moved to the state ``save_state`` wrote in ``directory``."""
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckpt:
        iterator.set_state(ckpt.restore(pathlib.Path(directory).absolute()))
    return iterator


def process_state_file(workdir, step: int, host) -> pathlib.Path:
    """Where process ``host[0]`` of ``host[1]`` keeps its iterator state at checkpoint
    ``step`` (Grain's own per-process name, ``process_I-of-N.json``)."""
    index, count = host
    return pathlib.Path(workdir) / STATE_DIR / str(int(step)) / f"process_{index}-of-{count}.json"


def save_process_state(workdir, step: int, host, state, keep=()) -> None:
    """Writes this process's ``state`` for ``step`` (atomically) and removes its states of
    steps not in ``keep`` (the checkpoints still there)."""
    import json

    if state is None:
        return
    file = process_state_file(workdir, step, host)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(file)
    for old in (pathlib.Path(workdir) / STATE_DIR).glob("*/" + file.name):
        if old.parent.name.isdigit() and int(old.parent.name) not in {*keep, int(step)}:
            old.unlink(missing_ok=True)


def load_process_state(workdir, step: int, host) -> dict | None:
    """The state ``save_process_state`` wrote, or None (then the pipeline replays)."""
    import json

    file = process_state_file(workdir, step, host)
    return json.loads(file.read_text()) if file.is_file() else None


class StepSampler:
    """``train_batch(seed, step, batch_size)`` over a Grain ``MapDataset``: batch ``step`` is
    ``dataset[step]``, a pure function of (seed, step), so there is no state to save."""

    def __init__(self, make):
        self._make, self._key, self._ds = make, None, None

    def __call__(self, seed: int, step: int, batch_size: int) -> dict:
        if self._key != (seed, batch_size):
            self._key, self._ds = (seed, batch_size), self._make(seed, batch_size)
        return self._ds[step]


class GrainSampler:
    """``train_batch(seed, step, batch_size)`` over a Grain iterator: consecutive steps read
    the next batch. ``get_state()``/``set_state()`` save and restore where it stands (the
    run keeps it in its checkpoint); any other step rebuilds the iterator and moves it to
    that step by replaying the batches before it, which Grain reproduces exactly."""

    def __init__(self, make):
        self._make, self._key, self._it, self._next = make, None, None, 0

    def __call__(self, seed: int, step: int, batch_size: int) -> dict:
        if self._key != (seed, batch_size) or step < self._next:
            self._key, self._next = (seed, batch_size), 0
            self._it = iter(self._make(seed, batch_size))
        while self._next < step:
            next(self._it)
            self._next += 1
        self._next += 1
        return next(self._it)

    def get_state(self) -> dict | None:
        if self._it is None:
            return None
        seed, batch_size = self._key
        state = self._it.get_state()
        return {"seed": seed, "batch_size": batch_size, "step": self._next, "iterator": state}

    def set_state(self, state: dict) -> None:
        self._key = (int(state["seed"]), int(state["batch_size"]))
        self._it = iter(self._make(*self._key))
        self._it.set_state(state["iterator"])
        self._next = int(state["step"])
