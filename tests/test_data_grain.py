"""Grain as the input pipeline (``data.pipeline="grain"``): chunks, global shuffle, sharding by
process, packing with segment ids the model honours, the iterator state saved with Orbax."""

import numpy as np
import pytest

pytest.importorskip("grain")

from attnlab.data.grain_pipeline import (  # noqa: E402
    DocumentChunks,
    GrainSampler,
    packed_batches,
    restore_state,
    save_state,
)

# Token i of the corpus is i: a segment of a packed row must be a run of consecutive ids
# inside one document, which the test reads back from the ids alone.
ENDS = np.cumsum([5, 40, 3, 17, 1, 60, 9, 25, 33, 2, 70, 12] * 4)
TOKENS = np.arange(ENDS[-1], dtype=np.uint32)


def _batches(n, **kw):
    options = dict(seq_len=15, batch_size=4, seed=3, bins=4) | kw
    it = iter(packed_batches(TOKENS, ENDS, **options))
    return [next(it) for _ in range(n)]


def test_document_chunks_cut_documents_at_the_window_and_the_split():
    chunks = DocumentChunks([5, 12, 13, 30], 4, limit=25)
    # [0,5) -> [0,4) [4,5)x; [5,12) -> [5,9) [9,12); [12,13)x; [13,25) -> 3 windows
    assert [chunks[i] for i in range(len(chunks))] == [
        (0, 4),
        (5, 9),
        (9, 12),
        (13, 17),
        (17, 21),
        (21, 25),
    ]
    # A document of 2 tokens keeps its one chunk; empty documents have none.
    chunks = DocumentChunks([2, 2, 7], 4)
    assert [chunks[i] for i in range(len(chunks))] == [(0, 2), (2, 6)]


def test_packed_rows_hold_whole_chunks_of_one_document_per_segment():
    doc_of = np.searchsorted(ENDS, TOKENS, side="right")
    for batch in _batches(6):
        seg_BT = batch["segment_ids"]
        for inp, tgt, seg, pos, mask in zip(
            batch["inputs"],
            batch["targets"],
            seg_BT,
            batch["positions"],
            batch["loss_mask"],
            strict=True,
        ):
            for s in set(seg[seg > 0].tolist()):
                run = inp[seg == s]
                assert (np.diff(run) == 1).all() and len(set(doc_of[run].tolist())) == 1
            # a target counts exactly when it continues its input's document
            expected = (tgt == inp + 1) & (doc_of[tgt] == doc_of[inp]) & (seg > 0)
            assert np.array_equal(mask > 0, expected)
            assert np.array_equal(pos[seg > 0], _restarts(seg)[seg > 0])


def _restarts(seg):
    pos, last, n = np.zeros(len(seg), np.int64), None, 0
    for i, s in enumerate(seg):
        n = 0 if s != last else n + 1
        pos[i], last = n, s
    return pos


def test_the_shuffle_is_deterministic_per_seed():
    a, b, c = _batches(3), _batches(3), _batches(3, seed=4)
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c, strict=True))


def test_processes_read_disjoint_chunks():
    firsts = []
    for host in ((0, 2), (1, 2)):
        seen = set()
        for batch in _batches(3, host=host):
            assert batch["inputs"].shape == (2, 15)
            seg = batch["segment_ids"]
            starts = (seg > 0) & np.concatenate(
                [np.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1
            )
            seen |= set(batch["inputs"][starts].tolist())
        firsts.append(seen)
    assert firsts[0] and firsts[1] and not firsts[0] & firsts[1]


def test_the_iterator_state_saved_with_orbax_resumes_bitwise(tmp_path):
    it = iter(packed_batches(TOKENS, ENDS, seq_len=15, batch_size=4, seed=3, bins=4))
    for _ in range(3):
        next(it)
    save_state(tmp_path / "data", it)
    after = [next(it) for _ in range(4)]
    fresh = iter(packed_batches(TOKENS, ENDS, seq_len=15, batch_size=4, seed=3, bins=4))
    restore_state(tmp_path / "data", fresh)
    again = [next(fresh) for _ in range(4)]
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(after, again, strict=True) for k in x)


def test_the_sampler_gives_any_step_as_a_run_from_the_start_would():
    def make(seed, batch_size):
        return packed_batches(TOKENS, ENDS, seq_len=15, batch_size=batch_size, seed=seed, bins=4)

    straight = GrainSampler(make)
    sequence = [straight(3, step, 4) for step in range(6)]
    resumed = GrainSampler(make)  # a run resumed at step 4
    for step in (4, 5, 2):
        got, want = resumed(3, step, 4), sequence[step]
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_packed_documents_do_not_attend_to_each_other():
    import jax.numpy as jnp

    from attnlab import ModelConfig, build_model

    model = build_model(
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_len=16, position="rope")
    )
    (batch,) = _batches(1, seq_len=15)
    ids = batch["inputs"] % 64
    packed = np.asarray(
        model(
            jnp.asarray(ids),
            segment_ids_BT=jnp.asarray(batch["segment_ids"]),
            positions_BT=jnp.asarray(batch["positions"]),
        ).logits
    )
    # each document alone at the start of a row (causal: the padding after it changes nothing)
    pieces = [
        (r, batch["segment_ids"][r] == s)
        for r in range(ids.shape[0])
        for s in set(batch["segment_ids"][r].tolist()) - {0}
    ]
    alone_ids = np.zeros((len(pieces), ids.shape[1]), np.int32)
    for i, (r, keep) in enumerate(pieces):
        alone_ids[i, : keep.sum()] = ids[r][keep]
    alone = np.asarray(model(jnp.asarray(alone_ids)).logits)
    for i, (r, keep) in enumerate(pieces):
        np.testing.assert_allclose(packed[r][keep], alone[i, : keep.sum()], rtol=1e-5, atol=1e-5)


def test_a_task_restores_its_pipeline_state_without_replaying(tmp_path):
    import json

    from attnlab.data import make_task
    from attnlab.data.prepared import prepare

    (tmp_path / "a.txt").write_text("".join(f"line {i} of the first file\n" for i in range(60)))
    (tmp_path / "b.txt").write_text("".join(f"row {i}, the second\n" for i in range(80)))
    prepare([str(tmp_path / "*.txt")], tmp_path / "p", tokenizer="byte", progress=False)
    cfg = {"kind": "prepared", "path": str(tmp_path / "p"), "seq_len": 24, "pipeline": "grain"}
    task = make_task(cfg)
    for step in range(4):
        task.train_batch(5, step, 4)
    state = json.loads(json.dumps(task.data_state()))  # as the checkpoint's metadata holds it
    assert state["step"] == 4
    want = [task.train_batch(5, step, 4) for step in (4, 5)]
    resumed = make_task(cfg)
    resumed.restore_data_state(state)
    resumed._train_batches._make = None  # a replay would have to rebuild the iterator
    got = [resumed.train_batch(5, step, 4) for step in (4, 5)]
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(want, got, strict=True) for k in a)
    assert make_task({**cfg, "pipeline": "index"}).data_state() is None


@pytest.mark.slow(reason="trains a tiny run three times on the Grain pipeline")
def test_a_run_on_packed_grain_batches_resumes_bitwise(tmp_path):
    import run_checks

    from attnlab import runs
    from attnlab.runs.checkpoint import Checkpointer

    overrides = ["--config.data.pipeline=grain", "--config.train.steps=6"]
    overrides += ["--config.checkpoint.every_steps=3", "--config.eval.sample_tokens=0"]
    run_checks.straight_and_stopped(tmp_path, *overrides, stop_after=4)
    runs.train(run_checks.tiny(*overrides), tmp_path / "resumed", progress=False)
    with Checkpointer(tmp_path / "resumed" / "checkpoints") as ckpt:
        assert ckpt.restore_metadata(4)["data_state"]["step"] == 4  # resumed from the state
    a, b = runs.load_run(tmp_path / "straight"), runs.load_run(tmp_path / "resumed")
    assert a.step == b.step == 6
    run_checks.assert_same_params(a, b)
