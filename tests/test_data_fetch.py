"""Downloads into the cache: checksums verified, nothing kept on a mismatch, clear messages."""

import hashlib
import shutil

import pytest
from conftest import REPO

from attnlab import experiment
from attnlab.cli import main
from attnlab.data import make_task
from attnlab.data.fetch import CACHE_ENV, ChecksumError, fetch, resolve


def test_fetch_a_file_url_with_the_right_and_the_wrong_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "corpus.txt"
    source.write_text("some text\n" * 100)
    good = hashlib.sha256(source.read_bytes()).hexdigest()
    with pytest.raises(ChecksumError, match="nothing was kept"):
        fetch(source.as_uri(), sha256="0" * 64, progress=False)
    assert not any((tmp_path / "cache").iterdir())
    got = fetch(source.as_uri(), sha256=good, progress=False)
    assert got == tmp_path / "cache" / "corpus.txt" and got.read_bytes() == source.read_bytes()
    source.write_text("changed")  # a cached file with the right checksum is not fetched again
    assert fetch(source.as_uri(), sha256=good, progress=False).read_text().startswith("some")
    assert main(["data", "fetch", source.as_uri(), "--sha256", "1" * 64, "--no-progress"]) == 2


def test_a_missing_dataset_names_the_command_that_fetches_it(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="attnlab data fetch shakespeare"):
        resolve("cache:shakespeare")
    with pytest.raises(FileNotFoundError, match="attnlab data fetch shakespeare"):
        make_task({"path": str(tmp_path / "elsewhere" / "tinyshakespeare.txt"), "seq_len": 8})


def test_the_shakespeare_experiment_reads_the_cache(tmp_path, monkeypatch, shared_dir):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    shutil.copy(shared_dir / "data" / "tinyshakespeare.txt", tmp_path / "tinyshakespeare.txt")
    assert fetch("shakespeare", progress=False) == tmp_path / "tinyshakespeare.txt"  # verified
    cfg = experiment.load_config(f"{REPO / 'experiments' / 'shakespeare_char.py'}:tiny")
    assert cfg.data.path == "cache:shakespeare"
    task = make_task(cfg.data, tmp_path / "run")
    assert len(task.train_ids) + len(task.val_ids) == 20_000  # the tiny twin's max_chars
