"""Plots build from real run directories and reject missing ones."""

import json

import pytest

from attnlab import viz


def _fake_run(path, losses):
    path.mkdir()
    lines = [
        json.dumps({"step": i + 1, "train_loss": x, **({"eval_loss": x + 0.1} if i % 2 else {})})
        for i, x in enumerate(losses)
    ]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_loss_curves_plot_every_run(tmp_path):
    a = _fake_run(tmp_path / "a", [3.0, 2.0, 1.5, 1.2])
    b = _fake_run(tmp_path / "b", [3.1, 2.5, 2.2, 2.0])
    fig = viz.plot_loss_curves([a, b])
    lines = fig.axes[0].get_lines()
    assert len(lines) == 4  # train and eval for each run
    assert list(lines[0].get_ydata()) == [3.0, 2.0, 1.5, 1.2]
    assert list(lines[1].get_ydata()) == pytest.approx([2.1, 1.3])
    out = viz.save_loss_curves([a, b], tmp_path / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        viz.plot_loss_curves([tmp_path / "nope"])
