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
    trials = [(t.cfg.model.position, t.cfg.data.tasks, t.cfg.train.seed) for t in plan.trials]
    kinds = (*positions, "sinusoidal")  # the second sinusoidal row scales its token embeddings
    assert sorted(trials) == sorted((p, t, s) for p in kinds for t in tasks for s in (0, 1))
    scaled = [t.cfg.data.tasks for t in plan.trials if t.cfg.model.embed_scale]
    assert scaled == [t for t in tasks for _ in (0, 1)]
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


def _study():
    from attnlab.experiment import import_file

    return import_file(EXPERIMENT)


def test_reciprocal_ranks_rank_each_task_past_the_trained_lengths_and_ties_share():
    results = {
        "a": {"copy": {5: 0.0, 15: 1.0, 20: 1.0}, "sort": {5: 1.0, 15: 0.2}},
        "b": {"copy": {5: 1.0, 15: 0.5, 20: 0.5}, "sort": {5: 0.0, 15: 0.2}},
        "c": {"copy": {5: 1.0, 15: 0.0, 20: 0.1}, "sort": {5: 1.0, 15: 0.1}},
    }
    # copy past 10: a 1.0, b 0.5, c 0.05 -> ranks 1, 2, 3; sort: a = b = 0.2 -> 1, 1; c 3.
    study = _study()
    mrr = study.reciprocal_ranks(results, 10)
    np.testing.assert_allclose([mrr["a"], mrr["b"], mrr["c"]], [1.0, 0.75, 1 / 3])
    # Over copy alone: a 1, b 1/2, c 1/3. Solved at the trained lengths (some kind's mean at
    # <= 10 is 0.9 or more): copy (b and c score 1.0 at 5) and sort (a and c).
    np.testing.assert_allclose(list(study.reciprocal_ranks(results, 10, ["copy"]).values()),
                               [1.0, 0.5, 1 / 3])  # fmt: skip
    assert study.solved_tasks(results, 10) == ["copy", "sort"]
    assert study.solved_tasks(results, 10, at=1.01) == []


@pytest.mark.slow(reason="trains three tiny trials and scores them at four lengths")
def test_the_report_puts_each_trials_task_under_its_position_and_averages_seeds(tmp_path):
    from attnlab import runs

    study = _study()
    plan = sweep.load_sweep(f"{EXPERIMENT}:per_task_tiny", max_trials=3)
    trials = [(t.cfg.model.position, t.cfg.data.tasks, t.cfg.train.seed) for t in plan.trials]
    assert trials == [("learned", "copy", 0), ("learned", "copy", 1), ("learned", "reverse", 0)]
    for i, trial in enumerate(plan.trials):
        runs.train(trial.cfg, tmp_path / f"trial{i}", progress=False)
    results = study.report(tmp_path, variant="per_task_tiny", rows=16)
    saved = json.loads((tmp_path / "nope.json").read_text())
    lengths = study.lengths_of("per_task_tiny")
    for kind in ("exact_match", "token_accuracy"):
        assert list(saved[kind]) == ["learned"]
        assert list(saved[kind]["learned"]) == ["copy", "reverse"]
        assert sorted(saved["per_seed"][kind]["learned"]) == ["0", "1"]
    # Each trial's own scores: copy is the mean of its two seeds, reverse its one trial's.
    scores = [study.score_run(tmp_path / f"trial{i}", lengths, rows=16) for i in (0, 1, 2)]
    copy = [scores[i]["exact_match"]["copy"] for i in (0, 1)]
    reverse = scores[2]["exact_match"]["reverse"]
    for n in lengths:
        assert results["exact_match"]["learned"]["copy"][n] == (copy[0][n] + copy[1][n]) / 2
        assert results["exact_match"]["learned"]["reverse"][n] == reverse[n]
    assert "| learned |" in (tmp_path / "nope.md").read_text()
    assert (tmp_path / "nope.png").stat().st_size > 0
