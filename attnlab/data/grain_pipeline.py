"""The input pipeline: every text batch comes from Grain (``data.pipeline``).

A batch is one global batch of ``train.batch_size`` rows whose content and row order depend
on the seed and the step only, never on how many processes or devices read it: process ``i``
of ``n`` keeps rows ``[i * B/n, (i + 1) * B/n)`` of it (``process_rows``), the rows its
devices hold (``attnlab.devices.rows.process_rows`` checks the mesh agrees), so one
process on one device, 8 devices and 2 processes x 4 devices train on the same batches, and
a run resumed with another process count continues the same order.

``"grain"`` (the default): packed language-model batches from a corpus's documents, every
stage Grain's own:

1. a ``MapDataset`` over the training split's documents (``documents.npy``), each cut into
   chunks of at most ``seq_len + 1`` tokens (``DocumentChunks``);
2. a global shuffle of the chunks, deterministic per seed and different in every epoch
   (``shuffle`` then ``repeat``);
3. first-fit packing into rows of ``seq_len + 1`` tokens with per-document segment ids
   and positions (``FirstFitPackIterDataset``). Packing needs only the chunks' lengths, so
   it packs chunk numbers, not tokens: every process packs the same global rows (cheap
   index arithmetic, no reads);
4. batching (``batch``) into global batches of ``batch_size`` rows;
5. each process reads the tokens of its rows only (``tokens[chunk start + position]``,
   from the memory-mapped ``tokens.bin``);
6. a thread that keeps ``PREFETCH`` batches ready (``ThreadPrefetchIterDataset``), or with
   ``data.workers > 0`` that many worker processes (``mp_prefetch``).

Each row gives ``inputs``/``targets`` (the row without its last/first token),
``segment_ids`` (1, 2, ... per document in the row, 0 for padding; the model attends within
a segment only), ``positions`` (restarting at 0 in each document) and ``loss_mask``
(1 where the target continues the input's document). The iterator's state
(``iterator.get_state()``) is a small dict, the same on every process (the packing is
global): ``save_state``/``restore_state`` write and read it with Orbax, and a run keeps it
in its checkpoint's metadata, so a pipeline resumes at the batch where it stopped, bitwise,
with any process count.

``"index"`` (and masked-language-model text, which is not packed): windows of the token
stream at every offset, globally shuffled per seed and batched by a Grain ``MapDataset``,
each process reading the windows of its rows; batch ``step`` is ``dataset[step]``, a pure
function of (seed, step), so there is no state to save. Evaluation batches are
``MapDataset`` reads too.
"""

from __future__ import annotations

import pathlib

import numpy as np

from attnlab.devices.rows import block_rows as process_rows  # noqa: F401  (read here too)

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


def _grain():
    from attnlab.errors import optional_import

    return optional_import("grain", None, "text data (data.kind, data.pipeline)")


def window_batches(
    tokens, *, window: int, batch_size: int, seed: int, host=(0, 1), map_fn=None, random_fn=None
):
    """The Grain ``MapDataset`` of this process's rows of the global batches of
    ``window``-token rows of ``tokens`` at every offset: a global shuffle per seed (new in
    each epoch), ``batch_size`` offsets a global batch, process ``i`` of ``n`` reading the
    windows of its rows (``process_rows``), then ``map_fn(rows)`` or ``random_fn(rng,
    rows)``. Batch ``step`` is ``dataset[step]``.

    ``random_fn`` draws for the whole global batch from one generator per (seed, step) and
    is given the global shape (other processes' rows zero): its draws must depend on the
    rows' shape only, so each row's draws do not depend on the process count."""
    grain = _grain()
    rows = process_rows(batch_size, host)
    offsets = len(tokens) - window + 1
    stride = -(-offsets // MAX_OFFSETS)  # Grain's index shuffle takes 32-bit indices
    ds = grain.MapDataset.range(0, offsets, stride).shuffle(seed=seed).repeat()
    ds = ds.batch(batch_size, drop_remainder=True)  # the global batch's offsets

    def read(starts):
        return np.stack([np.asarray(tokens[s : s + window], np.int32) for s in starts[rows]])

    ds = ds.map(read)
    if random_fn is not None:  # a generator per (seed, batch index): a pure function of both

        def corrupt(mine, rng):
            whole = np.zeros((batch_size, *mine.shape[1:]), mine.dtype)
            whole[rows] = mine
            return {k: v[rows] for k, v in random_fn(rng, whole).items()}

        ds = ds.random_map(corrupt, seed=seed)
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

    def start_of(self, i):
        """The first token of each chunk in the integer array ``i``."""
        doc = np.searchsorted(self.first, i, side="right") - 1
        return self.starts[doc] + (i - self.first[doc]) * self.length


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
    """The Grain ``IterDataset`` of this process's rows of the packed global batches (see the
    module's text)."""
    grain = _grain()
    rows = process_rows(batch_size, host)
    window = seq_len + 1
    chunks = DocumentChunks(ends, window, limit)
    if len(chunks) == 0:
        raise ValueError("the corpus has no chunk of two tokens or more")

    def number(i):  # the packer sees a chunk's length and number, never its tokens
        start, end = chunks[i]
        return {"chunk": np.full(end - start, i, np.int64)}

    def read(batch):  # this process's rows: their tokens, read from ``tokens``
        chunk, seg = batch["chunk"][rows], batch["chunk_segment_ids"][rows]
        pos = batch["chunk_positions"][rows]
        at = np.where(seg > 0, chunks.start_of(chunk) + pos, 0)
        ids = np.where(seg > 0, np.asarray(tokens[at.ravel()]).reshape(at.shape), 0)
        return lm_fields({"ids": ids, "ids_segment_ids": seg, "ids_positions": pos})

    ds = grain.MapDataset.range(len(chunks)).shuffle(seed=seed)
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=4 * read_threads)
    ds = ds.repeat().map(number).to_iter_dataset(options)
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"chunk": window}, num_packing_bins=bins, seed=seed
    )
    ds = ds.batch(batch_size, drop_remainder=True).map(read)
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
