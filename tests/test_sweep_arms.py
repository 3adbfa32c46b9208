"""The arms x seeds harness (attnlab.sweep.arms) that the comparison experiments share."""

import json
import pathlib

import numpy as np

from attnlab import experiment
from attnlab.sweep import arms

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_mean_std_is_the_sample_std_and_zero_for_one_value():
    assert arms.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert arms.mean_std([4.0]) == (4.0, 0.0)


def test_each_arm_trains_at_each_seed_and_reopens(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 200)

    def get_config():
        path = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
        overrides = [f"--config.data.path={corpus}", "--config.eval.sample_tokens=0"]
        return experiment.load_config(path, overrides)

    seen = []

    def measure(record, workdir):
        seen.append((workdir.name, int(record["step"])))
        return {"loss": float(record["train_loss"])}

    two = {"base": {}, "narrow_ffn": {"d_ff": 32}}
    runs = arms.train_arms(get_config, two, tmp_path, seeds=(0, 1), steps=2, measure=measure)
    assert list(runs) == ["base", "narrow_ffn"] and all(len(r) == 2 for r in runs.values())
    assert seen == [("base_s0", 2), ("base_s1", 2), ("narrow_ffn_s0", 2), ("narrow_ffn_s1", 2)]
    assert runs["base"][0] != runs["base"][1]  # the seed reached the run
    again = arms.train_arms(get_config, two, tmp_path, seeds=(0, 1), measure=measure,
                            reopen=True)  # fmt: skip
    assert again == runs

    drawn = []
    table = lambda runs: {arm: arms.mean_std([r["loss"] for r in rs]) for arm, rs in runs.items()}
    markdown = lambda t, n: f"{len(t)} arms, {n} seeds\n"
    plot = lambda t, path: drawn.append(path)
    figure = tmp_path / "docs" / "figure.png"
    t = arms.report(tmp_path, "losses", runs, table=table, markdown=markdown, plot=plot,
                    figure=figure, n_seeds=2, quick=True)  # fmt: skip
    assert drawn == [tmp_path / "figure.png"]  # quick: beside the runs, not in the docs
    assert json.loads((tmp_path / "losses.json").read_text())["table"]["base"] == list(t["base"])
    assert (tmp_path / "losses.md").read_text() == "2 arms, 2 seeds\n"
    assert arms.read_runs(tmp_path, "losses") == runs
    assert np.isfinite([r["loss"] for rs in runs.values() for r in rs]).all()


def test_quick_takes_the_first_seed_for_a_few_steps():
    args = arms.parser("doc").parse_args(["--run", "x", "--quick"])
    assert arms.seeds_and_steps(args, (3, 4)) == ((3,), arms.QUICK_STEPS)
    args = arms.parser("doc").parse_args(["--run", "x"])
    assert arms.seeds_and_steps(args, (3, 4)) == ((3, 4), None)
