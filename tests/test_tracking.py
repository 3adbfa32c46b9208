"""TensorBoard, Weights & Biases (offline) and profile traces of a tiny run."""

import json
import pathlib
import subprocess
import sys

import pytest

from attnlab import experiment, runs

REPO = pathlib.Path(__file__).resolve().parents[1]
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard's event reader checks the event files",
)


def test_events_hold_the_metrics_wandb_offline_and_a_profile_trace(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb writes the offline run")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    cfg = experiment.load_config(
        f"{REPO / 'experiments' / 'char_lm.py'}:tiny",
        [
            "--config.train.steps=4",
            "--config.eval.every_steps=2",
            "--config.eval.sample_tokens=0",
            "--config.train.profile_steps=2,3",
            "--config.track.wandb_project=attnlab-test",
            "--config.track.wandb_mode=offline",
        ],
    )
    work = tmp_path / "run"
    runs.train(cfg, work, progress=False)
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    events = event_accumulator.EventAccumulator(str(work / "tb"))
    events.Reload()
    for key in ("train_loss", "eval_loss"):
        want = [(r["step"], r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want] and len(want) >= 2
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    assert list((work / "wandb").glob("offline-run-*/*.wandb"))
    traces = list((work / "tb" / "plugins" / "profile").glob("*/*"))
    names = {p.name.split(".", 1)[-1] for p in traces} | {p.name for p in traces}
    assert "xplane.pb" in names and "perfetto_trace.json.gz" in names


@pytest.mark.slow(reason="a fresh interpreter imports the writer")
def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX imports torch where it is installed (1.9 s of a run's start-up); the
    tracker writes its events without it, and torch still imports afterwards."""
    pytest.importorskip("torch", reason="torch is installed only with the hf extra")
    code = (
        "import sys; from attnlab import experiment; from attnlab.runs.tracking import Tracker; "
        f"cfg = experiment.load_config({str(REPO / 'experiments' / 'char_lm.py')!r} + ':tiny'); "
        f"t = Tracker(cfg, {str(tmp_path)!r}); t.metrics({{'step': 1, 'train_loss': 2.5}}); "
        "t.close(); print('torch' in sys.modules); import torch; print(torch.ones(2).sum().item())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "2.0"]
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(1, 2.5)]


def test_profile_steps_are_checked():
    with pytest.raises(experiment.ExperimentError, match="train.profile_steps"):
        from attnlab.runs.tracking import parse_steps

        parse_steps("5,2")
