"""The `attnlab` command end to end on tiny runs: train, eval, plot, sample."""

import json
import pathlib
import shlex
import subprocess
import sys

import numpy as np
import pytest

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


@pytest.mark.slow(reason="trains and samples an encoder-decoder run: its own compiles")
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


@pytest.mark.slow(reason="a bfloat16 run compiles every step program again")
def test_bf16_compute_trains_with_float32_parameters(tmp_path):
    from attnlab import experiment, runs

    cfg = experiment.load_config(
        exp("char_lm"), ["--config.model.dtype=bfloat16", "--config.eval.sample_tokens=0"]
    )
    record = runs.train(cfg, tmp_path, progress=False)
    assert np.isfinite(record["train_loss"]) and np.isfinite(record["eval_loss"])
    params = runs.load_run(tmp_path).params
    import jax

    assert {leaf.dtype.name for leaf in jax.tree.leaves(params)} == {"float32"}


VARIANT_EXPERIMENT = """
import jax.numpy as jnp

import attnlab
from attnlab.experiment import base_config


def capped(q, k, v, **kw):
    return attnlab.ops.dot_product_attention(
        q, k, v, logits_fn=lambda s: 5.0 * jnp.tanh(s / 5.0), **kw
    )


attnlab.register_attention("capped_in_experiment", capped)


def get_config(variant=None):
    c = base_config()
    c.model.update(
        arch="decoder", vocab_size=256, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=16,
        position="rope", attention_fn="capped_in_experiment",
    )
    c.data.update(kind="text", path="", tokenizer="char", seq_len=16, max_chars=20_000)
    c.train.update(steps=2, batch_size=2, log_every_steps=1)
    c.eval.update(every_steps=2, batches=1, batch_size=2, sample_tokens=4, sample_prompt="def ")
    c.checkpoint.update(every_steps=2)
    return c


def sweep(variant=None):
    return [{"train.seed": 3}]
"""


def _attnlab(*args):
    cmd = [sys.executable, "-m", "attnlab.cli", *args]  # run in REPO: this checkout's attnlab
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.mark.slow(reason="fresh CLI processes, each starting JAX and compiling")
def test_a_variant_registered_by_its_experiment_file_reopens_in_fresh_processes(tmp_path, capsys):
    source = tmp_path / "capped.py"
    source.write_text(VARIANT_EXPERIMENT)
    root = tmp_path / "sweep"
    # The sweep's commands: each trains its trial in a fresh process.
    assert main(["sweep", "--config", str(source), "--workdir", str(root), "--print-commands"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    argv = shlex.split(line)
    assert argv[:2] == ["attnlab", "train"]
    trained = _attnlab(*argv[1:], "--no-progress")
    assert trained.returncode == 0, trained.stderr
    run = root / "train.seed=3"
    saved = json.loads((run / "config.json").read_text())
    assert saved["experiment_file"] == str(source.resolve())
    assert saved["model"]["attention_fn"] == "capped_in_experiment"
    assert saved["train"]["seed"] == 3

    evaluated = _attnlab("eval", "--workdir", str(run))
    assert evaluated.returncode == 0, evaluated.stderr
    assert np.isfinite(json.loads(evaluated.stdout)["eval_loss"])
    sampled = _attnlab("sample", "--workdir", str(run), "--prompt", "def ", "--max-new-tokens", "4")
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("def ")

    # Without the experiment file the variant cannot exist: the error names both.
    source.rename(tmp_path / "elsewhere.py")
    missing = _attnlab("eval", "--workdir", str(run))
    assert missing.returncode == 2
    assert "capped_in_experiment" in missing.stderr and str(source.resolve()) in missing.stderr
    assert "Traceback" not in missing.stderr
