"""Packed language-model batches from a prepared corpus through Grain (``data.pipeline="grain"``).

The pipeline, every stage Grain's own:

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
6. a thread that keeps ``PREFETCH`` batches ready (``ThreadPrefetchIterDataset``).

Each row gives ``inputs``/``targets`` (the row without its last/first token),
``segment_ids`` (1, 2, ... per document in the row, 0 for padding; the model attends within
a segment only), ``positions`` (restarting at 0 in each document) and ``loss_mask``
(1 where the target continues the input's document). The iterator's state
(``iterator.get_state()``) is a small dict: ``save_state``/``restore_state`` write and read
it with Orbax, so a pipeline resumes at the batch where it stopped, bitwise.
"""

from __future__ import annotations

import pathlib

import numpy as np

PACKING_BINS = 16  # rows packed at a time: more bins, less padding, more reordering
PREFETCH = 2  # batches a background thread keeps ready
# Threads reading chunks ahead of the packer. The reads are cheap slices of a memory map, so
# on a small machine the threads' hand-offs cost more than they save (2 shared cores: 9,400
# chunks/s with none, 5,600 with one, 3,400 with two); the prefetch thread overlaps the
# whole pipeline with the step instead.
READ_THREADS = 0


def _grain():
    import grain

    return grain


def document_chunks(ends, length: int, limit: int | None = None):
    """(starts, ends) of the documents ending at ``ends`` cut into chunks of at most
    ``length`` tokens, documents cut at ``limit`` (the end of the training split); chunks
    of one token (no target) are dropped."""
    ends = np.asarray(ends, np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    if limit is not None:
        keep = starts < limit
        starts, ends = starts[keep], np.minimum(ends[keep], limit)
    counts = -(-(ends - starts) // length)
    doc = np.repeat(np.arange(len(ends)), counts)
    offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    c_start = starts[doc] + offset * length
    c_end = np.minimum(c_start + length, ends[doc])
    keep = c_end - c_start > 1
    return c_start[keep], c_end[keep]


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
):
    """The Grain ``IterDataset`` of this process's packed batches (see the module's text)."""
    grain = _grain()
    index, count = host
    if batch_size % count:
        raise ValueError(f"train.batch_size={batch_size} must divide over {count} processes")
    window = seq_len + 1
    c_start, c_end = document_chunks(ends, window, limit)
    if len(c_start) < count:
        raise ValueError(f"the corpus has {len(c_start)} chunks, fewer than {count} processes")

    def read(i):
        return {"ids": np.asarray(tokens[c_start[i] : c_end[i]], np.int32)}

    ds = grain.MapDataset.range(len(c_start)).shuffle(seed=seed)[index::count]
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * read_threads)
    ds = ds.repeat().map(read).to_iter_dataset(options)
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"ids": window}, num_packing_bins=bins, seed=seed
    )
    ds = ds.batch(batch_size // count, drop_remainder=True).map(lm_fields)
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
