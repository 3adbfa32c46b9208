"""The `attnlab` command end to end on tiny runs: train, eval, plot, sample."""

import json
import pathlib

import numpy as np

from attnlab.cli import main

REPO = pathlib.Path(__file__).resolve().parents[1]


def exp(name):
    return str(REPO / "experiments" / f"{name}.py:tiny")


def test_train_eval_plot_sample_for_a_language_model(tmp_path, capsys):
    run = tmp_path / "lm"
    assert (
        main(
            [
                "train",
                "--no-progress",
                "--config",
                exp("char_lm"),
                "--workdir",
                str(run),
                "--config.eval.sample_tokens=4",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["eval", "--workdir", str(run)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 3 and np.isfinite(result["eval_loss"])
    assert main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    args = [
        "sample",
        "--workdir",
        str(run),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "6",
        "--seed",
        "1",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("def ") and len(first.rstrip("\n")) > len("def ")
    assert main(args) == 0
    assert capsys.readouterr().out == first  # seeded: the same text again


def test_sample_for_an_encoder_decoder_needs_a_source(tmp_path, capsys):
    run = tmp_path / "s2s"
    assert (
        main(["train", "--no-progress", "--config", exp("reverse_seq2seq"), "--workdir", str(run)])
        == 0
    )
    capsys.readouterr()
    assert (
        main(
            [
                "sample",
                "--workdir",
                str(run),
                "--source",
                "1 2 3",
                "--max-new-tokens",
                "4",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()


def test_bf16_compute_trains_with_float32_parameters(tmp_path):
    from attnlab import experiment, runs

    cfg = experiment.load_config(
        exp("char_lm"), ["--config.model.dtype=bfloat16", "--config.eval.sample_tokens=0"]
    )
    record = runs.train(cfg, tmp_path, progress=False)
    assert np.isfinite(record["train_loss"]) and np.isfinite(record["eval_loss"])
    _, _, _, params, _ = runs.load_run(tmp_path)
    import jax

    assert {leaf.dtype.name for leaf in jax.tree.leaves(params)} == {"float32"}
