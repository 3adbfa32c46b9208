"""Grain as the one input pipeline: windows read by index (a ``MapDataset``, batch ``step`` =
``dataset[step]``), evaluation batches, per-process iterator states and worker processes."""

import json

import numpy as np
import pytest

pytest.importorskip("grain")

from attnlab.data import grain_pipeline as gp  # noqa: E402
from attnlab.data import make_task  # noqa: E402
from attnlab.errors import DataError  # noqa: E402

# Token i is i: a row's first id is its window's offset.
TOKENS = np.arange(203, dtype=np.uint32)
WINDOW = 9


def _rows(seed, host, steps, batch_size=4):
    ds = gp.window_batches(TOKENS, window=WINDOW, batch_size=batch_size, seed=seed, host=host)
    return [ds[step] for step in range(steps)]


def test_windows_are_contiguous_and_a_pure_function_of_seed_and_step():
    a, b = _rows(3, (0, 1), 5), _rows(3, (0, 1), 5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert all((np.diff(rows, axis=1) == 1).all() and rows.shape == (4, WINDOW) for rows in a)
    other = _rows(4, (0, 1), 5)
    assert not all(np.array_equal(x, y) for x, y in zip(a, other, strict=True))


def test_processes_share_out_every_offset_of_an_epoch_once():
    offsets = len(TOKENS) - WINDOW + 1  # 195 windows: 2 processes x 2 rows a batch
    steps = offsets // 4
    firsts = [np.concatenate(_rows(5, (i, 2), steps, 4))[:, 0] for i in range(2)]
    assert all(f.shape == (2 * steps,) for f in firsts)
    seen = np.concatenate(firsts)
    assert len(set(seen.tolist())) == len(seen)  # disjoint, no window twice in an epoch
    assert set(seen.tolist()) <= set(range(offsets)) and len(seen) == offsets - offsets % 4
    # the order is shuffled, not the stream in order
    assert not np.array_equal(np.sort(firsts[0]), firsts[0])


def test_the_index_pipeline_has_no_state_and_mlm_text_reads_windows():
    cfg = {"kind": "text", "seq_len": 16, "max_chars": 5_000, "pipeline": "index"}
    task = make_task(cfg)
    batch = task.train_batch(2, 7, 4)
    assert task.data_state() is None and sorted(batch) == ["inputs", "loss_mask", "targets"]
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    mlm = make_task({**cfg, "kind": "mlm_text", "pipeline": "grain"})
    x, y = mlm.train_batch(2, 7, 4), mlm.train_batch(2, 7, 4)
    assert all(np.array_equal(x[k], y[k]) for k in x) and mlm.data_state() is None
    assert (x["inputs"] == mlm.mask_id).any()


def test_full_evaluation_reads_every_target_once_in_fixed_shape_batches():
    ids = np.arange(50, dtype=np.int32) * 3
    batches = list(gp.consecutive_batches(ids, seq_len=8, batch_size=4))
    assert [b["inputs"].shape for b in batches] == [(4, 8), (4, 8)]
    keep = np.concatenate([b["loss_mask"].ravel() for b in batches]) > 0
    targets = np.concatenate([b["targets"].ravel() for b in batches])[keep]
    inputs = np.concatenate([b["inputs"].ravel() for b in batches])[keep]
    np.testing.assert_array_equal(targets, ids[1:])
    np.testing.assert_array_equal(inputs, ids[:-1])


def test_spread_evaluation_windows_cover_the_split_from_end_to_end():
    batches = gp.spread_batches(
        TOKENS, window=WINDOW, batch_size=3, num_batches=2, map_fn=lambda i, rows: (i, rows)
    )
    assert [i for i, _ in batches] == [0, 1]
    rows = np.concatenate([r for _, r in batches])
    assert rows[0, 0] == 0 and rows[-1, -1] == len(TOKENS) - 1
    assert (np.diff(rows[:, 0]) > 0).all() and (np.diff(rows, axis=1) == 1).all()


def _prepared(tmp_path):
    from attnlab.data.prepared import prepare

    (tmp_path / "a.txt").write_text("".join(f"line {i} of the first file\n" for i in range(60)))
    (tmp_path / "b.txt").write_text("".join(f"row {i}, the second\n" for i in range(80)))
    prepare([str(tmp_path / "*.txt")], tmp_path / "p", tokenizer="byte", progress=False)
    return {"kind": "prepared", "path": str(tmp_path / "p"), "seq_len": 24}


def test_a_state_saved_by_one_process_resumes_any_process_count(tmp_path):
    """Every process packs the same global rows, so each holds the same iterator state: the
    state process 1 of 2 saved moves processes of 1, 2 or 4 to the same place."""
    cfg = _prepared(tmp_path)
    task = make_task(cfg, host=(1, 2))
    for step in range(3):
        task.train_batch(5, step, 4)
    state = json.loads(json.dumps(task.data_state()))  # as the checkpoint's metadata holds it
    assert state["step"] == 3
    for host in ((0, 1), (0, 2), (1, 2), (3, 4)):
        want = [make_task(cfg, host=host).train_batch(5, step, 4) for step in (3, 4)]
        resumed = make_task(cfg, host=host)
        resumed.restore_data_state(state)
        resumed._train_batches._make = None  # a replay would have to rebuild the iterator
        got = [resumed.train_batch(5, step, 4) for step in (3, 4)]
        assert all(np.array_equal(a[k], b[k]) for a, b in zip(want, got, strict=True) for k in a)
        assert want[0]["inputs"].shape == (4 // host[1], 24)


def test_bad_pipeline_settings_are_one_line_naming_the_field():
    cfg = {"kind": "text", "seq_len": 16, "max_chars": 5_000}
    for bad, field in (({"workers": -1}, "data.workers"), ({"pipeline": "x"}, "data.pipeline")):
        with pytest.raises(DataError, match=field) as err:
            make_task({**cfg, **bad})
        assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="data.workers"):
        make_task({**cfg, "pipeline": "index", "workers": 1})


@pytest.mark.slow(reason="starts a Grain worker process")
def test_a_worker_process_gives_the_batches_and_state_of_the_inline_pipeline(tmp_path):
    cfg = _prepared(tmp_path)
    inline, worker = make_task(cfg), make_task({**cfg, "workers": 1})
    for step in range(3):
        a, b = inline.train_batch(1, step, 4), worker.train_batch(1, step, 4)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    resumed = make_task({**cfg, "workers": 1})
    resumed.restore_data_state(json.loads(json.dumps(worker.data_state())))
    a, b = inline.train_batch(1, 3, 4), resumed.train_batch(1, 3, 4)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow(reason="three training processes, one killed with SIGKILL")
def test_a_packed_run_killed_with_sigkill_resumes_bitwise(tmp_path):
    import signal

    import run_checks

    from attnlab import runs
    from attnlab.runs.checkpoint import Checkpointer

    def train(workdir):  # the default pipeline: packed
        args = ["train", "--no-progress", "--config", run_checks.TINY, "--workdir", str(workdir)]
        args += ["--config.train.steps=40", "--config.checkpoint.every_steps=10"]
        args += ["--config.checkpoint.max_to_keep=10"]
        args += ["--config.eval.sample_tokens=0", "--config.eval.every_steps=40"]
        return run_checks.cli_process(*args)

    straight = train(tmp_path / "straight")
    killed = train(tmp_path / "resumed")
    for line in killed.stdout:
        if line.startswith("step=25 "):  # checkpoints 10 and 20 written
            break
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    out, _ = train(tmp_path / "resumed").communicate(timeout=300)
    resumed_at = int(out.split("resuming from step ")[1].split()[0])
    assert resumed_at >= 20, out
    straight.communicate(timeout=300)
    assert straight.returncode == 0
    with Checkpointer(tmp_path / "resumed" / "checkpoints") as ckpt:
        state = ckpt.restore_metadata(resumed_at)["data_state"]
    assert state["step"] == resumed_at  # the pipeline resumed from its state, not a replay
    a, b = runs.load_run(tmp_path / "straight"), runs.load_run(tmp_path / "resumed")
    assert a.step == b.step == 40
    run_checks.assert_same_params(a, b)


@pytest.mark.slow(reason="trains a tiny run three times")
def test_a_run_of_several_processes_saves_and_restores_the_pipeline_state(tmp_path, monkeypatch):
    """Process 1 of 2 (its input pipeline's view; one device trains its half of the rows):
    the pipeline's state goes to the checkpoint's metadata and a resumed run reads it back."""
    import run_checks

    from attnlab import runs
    from attnlab.runs import workdir
    from attnlab.runs.checkpoint import Checkpointer

    monkeypatch.setattr(workdir, "_host", lambda: (1, 2))
    overrides = ["--config.train.steps=6", "--config.checkpoint.every_steps=3"]
    overrides += ["--config.eval.sample_tokens=0", "--config.checkpoint.max_to_keep=5"]
    run_checks.straight_and_stopped(tmp_path, *overrides, stop_after=4)
    with Checkpointer(tmp_path / "resumed" / "checkpoints") as ckpt:
        saved = ckpt.restore_metadata(4)["data_state"]
    assert saved["step"] == 4 and saved["batch_size"] == 4
    restored = []
    monkeypatch.setattr(
        workdir.Run, "initial_state", _spy(workdir.Run.initial_state, restored), raising=True
    )
    runs.train(run_checks.tiny(*overrides), tmp_path / "resumed", progress=False)
    assert restored == [4]  # moved to the saved state before the first step
    a, b = runs.load_run(tmp_path / "straight"), runs.load_run(tmp_path / "resumed")
    run_checks.assert_same_params(a, b)


def _spy(initial_state, seen):
    """``Run.initial_state`` that records the step its task's pipeline was moved to."""

    def wrapped(self, trainer, abstract):
        state = initial_state(self, trainer, abstract)
        seen.append(self.task.data_state()["step"])
        return state

    return wrapped
