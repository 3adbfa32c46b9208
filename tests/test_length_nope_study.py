"""experiments/length_nope.py's per-task study: one model per task and position kind, its rows
fitting each task, and a report that puts each trial's task under its position kind."""

import json
import pathlib

import numpy as np
import pytest

from attnlab import sweep
from attnlab.data import length_tasks, make_task
from attnlab.data.synthetic import NUM_SPECIAL, SEP

EXPERIMENT = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "length_nope.py"


@pytest.mark.parametrize("variant", ["per_task", "per_task_tiny"])
def test_every_position_kind_learns_every_task_alone_in_rows_that_fit(variant):
    plan = sweep.load_sweep(f"{EXPERIMENT}:{variant}")
    positions = ("learned", "sinusoidal", "rope", "relative", "alibi", "none")
    tasks = ("copy", "reverse", "sort", "addition", "parity")
    pairs = [(t.cfg.model.position, t.cfg.data.tasks) for t in plan.trials]
    assert sorted(pairs) == sorted((p, t) for p in (*positions, "sinusoidal") for t in tasks)
    scaled = [t.cfg.data.tasks for t in plan.trials if t.cfg.model.embed_scale]
    assert scaled == list(tasks)  # the second sinusoidal row scales its token embeddings
    train_max = 10 if variant == "per_task" else 4
    for trial in plan.trials:
        d = trial.cfg.data
        assert d.max_len == train_max and d.reverse_sum
        # The row of the longest trained problem fills the row exactly.
        assert length_tasks.row_len(d.tasks, train_max) == d.seq_len + 1
        # Twice that length (the longest scored) fits the position table.
        assert length_tasks.row_len(d.tasks, 2 * train_max) <= trial.cfg.model.max_len + 1
    # The addition rows are the sum least-significant digit first.
    cfg = next(t.cfg for t in plan.trials if t.cfg.data.tasks == "addition")
    batch = make_task(cfg.data.to_dict()).train_batch(0, 0, 8)
    for row, targets, mask in zip(batch["inputs"], batch["targets"], batch["loss_mask"],
                                  strict=True):  # fmt: skip
        x = [int(i) - NUM_SPECIAL for i in row[2 : list(row).index(SEP)]]
        plus = x.index(length_tasks.PLUS_SYMBOL)
        total = int("".join(map(str, x[:plus]))) + int("".join(map(str, x[plus + 1 :])))
        answer = [int(t) - NUM_SPECIAL for t in targets[mask > 0]][:-1]
        assert "".join(map(str, answer)) == str(total)[::-1]


@pytest.mark.slow(reason="trains two tiny trials and scores them at four lengths")
def test_the_report_puts_each_trials_task_under_its_position(tmp_path):
    import importlib.util

    from attnlab import runs

    spec = importlib.util.spec_from_file_location("length_nope", EXPERIMENT)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    plan = sweep.load_sweep(f"{EXPERIMENT}:per_task_tiny", max_trials=2)
    for i, trial in enumerate(plan.trials):
        workdir = tmp_path / f"trial{i}"
        runs.train(trial.cfg, workdir, progress=False)
    results = study.report(tmp_path, variant="per_task_tiny", rows=16)
    saved = json.loads((tmp_path / "nope.json").read_text())
    lengths = study.lengths_of("per_task_tiny")
    for kind in ("exact_match", "token_accuracy"):
        assert list(saved[kind]) == ["learned"]
        assert sorted(saved[kind]["learned"]) == ["copy", "reverse"]
        for by_length in results[kind]["learned"].values():
            assert sorted(by_length) == lengths
            assert all(0.0 <= v <= 1.0 for v in by_length.values())
    # Each cell is its own trial's score on its task (trial1 learned reverse).
    want = study.score_run(tmp_path / "trial1", lengths, rows=16)["reverse"]
    assert results["exact_match"]["learned"]["reverse"] == want
    assert (tmp_path / "nope.png").stat().st_size > 0
    assert np.isfinite(list(want.values())).all()
