"""Prepared corpora: memory-mapped token files give the in-memory batches, read lazily."""

import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.data import make_task
from attnlab.data.prepared import (
    DOCUMENTS_FILE,
    META_FILE,
    TOKENS_FILE,
    open_prepared,
    prepare,
    verify,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n" * 80


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_prepared_batches_equal_the_in_memory_batches(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text(TEXT)
    meta = prepare(
        [str(tmp_path / "*.txt")],
        tmp_path / "prep",
        tokenizer=tokenizer,
        vocab_size=300,
        progress=False,
    )
    assert meta["dtype"] == "uint16" and meta["train_tokens"] + meta["val_tokens"] == meta["tokens"]
    assert verify(tmp_path / "prep")
    _, tok, tokens = open_prepared(tmp_path / "prep")
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, tok.encode(TEXT))
    kept = str(tmp_path / "prep" / "tokenizer.json") if tokenizer == "bpe" else "byte"
    memory = make_task({"path": str(tmp_path / "a.txt"), "tokenizer": kept, "seq_len": 16})
    mapped = make_task(
        {"kind": "prepared", "path": str(tmp_path / "prep"), "seq_len": 16}, tmp_path / "run"
    )
    for step in (0, 7):
        a, b = memory.train_batch(3, step, 4), mapped.train_batch(3, step, 4)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    for a, b in zip(memory.eval_batches(4, 2), mapped.eval_batches(4, 2), strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert (tmp_path / "run" / "tokenizer.json").exists()  # the run keeps its tokenizer


def test_prepare_cli_and_uint32_for_large_vocabularies(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    args = [
        "data",
        "prepare",
        str(tmp_path / "a.txt"),
        "--out",
        str(tmp_path / "p"),
        "--tokenizer",
        "char",
        "--no-progress",
    ]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == len(TEXT)
    (tmp_path / "wide.txt").write_text("".join(chr(0x10000 + i) for i in range(66_000)))
    meta = prepare([tmp_path / "wide.txt"], tmp_path / "w", tokenizer="char", progress=False)
    assert meta["dtype"] == "uint32"


@pytest.mark.slow(reason="a child process reads a sparse 6 GB file under a memory limit")
def test_a_corpus_larger_than_the_process_may_read_is_memory_mapped(tmp_path):
    """A sparse 6 GB token file: batches come from it with a resident set far below that."""
    (tmp_path / "a.txt").write_text(TEXT)
    prep = tmp_path / "prep"
    prepare([tmp_path / "a.txt"], prep, tokenizer="byte", progress=False)
    n = 3 * 2**30  # uint16 tokens: 6 GiB on disk, no blocks allocated
    with open(prep / TOKENS_FILE, "r+b") as f:
        f.truncate(2 * n)
    meta = json.loads((prep / META_FILE).read_text())
    meta.update(tokens=n, train_tokens=n - 2**20, val_tokens=2**20)
    for checksum in ("crc32", "sha256"):  # a hand-made file: opening it checks none
        meta.pop(checksum)
    (prep / META_FILE).write_text(json.dumps(meta))
    np.save(prep / DOCUMENTS_FILE, np.array([n], np.int64))  # one document, as large
    # The peak resident set of this process's own memory (VmHWM): ru_maxrss would also count
    # the forked copy of the test process, whose size depends on the tests run before.
    script = textwrap.dedent(f"""
        import pathlib
        from attnlab.data import make_task
        task = make_task({{"kind": "prepared", "path": {str(prep)!r}, "seq_len": 64}})
        for step in range(20):
            task.train_batch(0, step, 32)
        task.eval_batches(32, 2)
        status = pathlib.Path("/proc/self/status").read_text().splitlines()
        print(next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) // 1024)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin"},
    )
    assert int(out.stdout.split()[-1]) < 2048  # MiB (imports included), against a 6144 MiB file
