"""Byte-level BPE trained with the tokenizers library: round trips, determinism, resuming."""

import pathlib

import numpy as np
import pytest

from attnlab import experiment, runs
from attnlab.data import load_tokenizer, make_task
from attnlab.data.bpe import HFTokenizer, train_bpe

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = "def f(x):\n    return x * 2  # doubles\n\nclass Ünïcode:\n    pass\n" * 60


def test_bpe_round_trips_and_is_deterministic(tmp_path):
    tok = train_bpe(TEXT, 300)
    assert 257 < tok.vocab_size <= 300
    for text in (TEXT[:200], "unseen wörds, emoji 🙂, tabs\tand  spaces\n", ""):
        assert tok.decode(tok.encode(text)) == text
    again = train_bpe(TEXT, 300)
    assert np.array_equal(again.encode(TEXT), tok.encode(TEXT)) and again == tok
    assert len(tok.encode(TEXT)) < len(TEXT.encode()) / 2  # it learned merges
    tok.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json")  # any tokenizer.json, by path
    assert isinstance(loaded, HFTokenizer) and loaded == tok
    task = make_task({"tokenizer": str(tmp_path / "tokenizer.json"), "seq_len": 8}, None)
    assert task.tokenizer == tok


@pytest.mark.slow(reason="trains, then resumes a run in a second training")
def test_a_tiny_run_trains_with_bpe_and_resumes_with_the_same_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    cfg = experiment.load_config(
        f"{REPO / 'experiments' / 'char_lm.py'}:tiny",
        [
            f"--config.data.path={corpus}",
            "--config.data.tokenizer=bpe",
            "--config.data.vocab_size=300",
            "--config.model.vocab_size=300",
            "--config.data.seq_len=16",
            "--config.train.steps=4",
            "--config.checkpoint.every_steps=2",
            "--config.eval.every_steps=2",
            "--config.eval.sample_tokens=0",
            "--config.track.tensorboard=False",
        ],
    )
    work = tmp_path / "run"
    runs.train(cfg, work, progress=False, stop_after=2)
    saved = (work / "tokenizer.json").read_text()
    assert isinstance(load_tokenizer(work / "tokenizer.json"), HFTokenizer)
    corpus.write_text(TEXT.upper())  # a retrained tokenizer would differ; the saved one is used
    record = runs.train(cfg, work, progress=False)
    assert record["step"] == 4 and np.isfinite(record["eval_loss"])
    assert (work / "tokenizer.json").read_text() == saved
