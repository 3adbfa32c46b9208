"""Damaged checkpoints and corpora, and a checkpoint directory that cannot be written: each
ends in one line naming the file and the fix, with the exit status of its kind, within
seconds, and leaves the work directory as it was."""

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
from test_bad_inputs import snapshot  # tests/ is on the path

from attnlab.cli import main
from attnlab.data.prepared import META_FILE, TOKENS_FILE, prepare
from attnlab.errors import WorkdirError
from attnlab.runs.checkpoint import Checkpointer

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
QUIET = ["--config.eval.batches=0", "--config.eval.sample_tokens=0"]


def cli(capsys, *argv) -> tuple[int, str]:
    """The exit status and the one line on stderr (asserted to be one, without a traceback)."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab ") and "Traceback" not in err, err
    return rc, lines[0]


@contextlib.contextmanager
def unwritable(directory: pathlib.Path):
    """``directory`` made unwritable for this process: mode 0555, or for root (whom modes do
    not stop) the immutable attribute, which refuses writes to root as well; skips where
    neither is possible."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: nothing here makes a directory unwritable")
    made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"running as root and chattr +i is refused here ({made.stderr.strip()})")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_an_unwritable_checkpoint_directory_is_refused_before_the_first_step(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    before = snapshot(run)
    with unwritable(run / "checkpoints"):
        start = time.perf_counter()
        rc, line = cli(capsys, "train", "--no-progress", "--config", TINY, "--workdir", run, *QUIET)
        seconds = time.perf_counter() - start
        assert snapshot(run) == before
    # The start-up checks catch it (runs/preflight.py); Run.begin's own probe is the backstop.
    assert rc == 2 and f"cannot write to {run / 'checkpoints'} (" in line, line
    assert "make it writable or choose another --workdir" in line
    assert seconds < 20, seconds  # it took 300 s, Orbax's threads waiting for the directory


def test_a_failed_save_leaves_no_thread_waiting(tmp_path):
    """A directory that turns unwritable after the start: the save fails at once and closing
    returns (Orbax's writers used to wait 300 s for the step directory, then print five
    TimeoutError tracebacks)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    ckpt = Checkpointer(directory)
    with unwritable(directory):
        with pytest.raises(WorkdirError, match=r"cannot write checkpoint step 1 in .*no earlier"):
            ckpt.save(1, {"w": np.ones(3, np.float32)})
        closing = threading.Thread(target=ckpt.close, daemon=True)
        closing.start()
        closing.join(timeout=20)
        assert not closing.is_alive()
    assert os.listdir(directory) == []


def test_an_edited_prepared_corpus_is_refused(tmp_path, capsys):
    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 120)
    prep = tmp_path / "prep"
    prepare([tmp_path / "text.txt"], prep, tokenizer="char", val_fraction=0.2, progress=False)
    meta = json.loads((prep / META_FILE).read_text())
    tokens = np.fromfile(prep / TOKENS_FILE, dtype=meta["dtype"])
    tokens[100], tokens[101] = tokens[101], tokens[100]  # same size, every id still valid
    assert tokens[100] != tokens[101]
    tokens.tofile(prep / TOKENS_FILE)
    before = snapshot(tmp_path)
    rc, line = cli(capsys, "train", "--no-progress", "--config", TINY, "--workdir",
                   tmp_path / "new", "--config.data.kind=prepared",
                   f"--config.data.path={prep}", *QUIET)  # fmt: skip
    assert rc == 2 and f"{prep / TOKENS_FILE} does not match the crc32 checksum" in line, line
    assert f"`attnlab data prepare FILES... --out {prep}`" in line
    assert snapshot(tmp_path) == before  # no work directory made


def values_file(step_dir: pathlib.Path) -> pathlib.Path:
    """The largest of Orbax's data files: the one holding the parameters' and the optimizer
    state's values."""
    return max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)


def flip_bit(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x08
    path.write_bytes(bytes(data))


def scramble(path: pathlib.Path, n: int = 2000) -> None:
    data = bytearray(path.read_bytes())
    start = (len(data) - n) // 2
    data[start : start + n] = np.random.default_rng(0).integers(0, 256, n, np.uint8).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.slow(reason="builds the shared tiny run (three trained steps) in this process")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", [flip_bit, scramble], ids=["one-bit", "2000-bytes"])
def test_a_damaged_checkpoint_is_reported_as_corrupt(tiny_lm_run, tmp_path, capsys, damage):
    run = pathlib.Path(shutil.copytree(tiny_lm_run, tmp_path / "run"))
    (run / "lock").unlink(missing_ok=True)
    damaged = values_file(run / "checkpoints" / "3")
    damage(damaged)
    before = snapshot(run)
    rc, line = cli(capsys, "eval", "--workdir", run, "--step", "3")
    name = damaged.relative_to(run / "checkpoints" / "3").as_posix()
    assert rc == 1 and f"checkpoint step 3 in {run / 'checkpoints'} is corrupt: {name}" in line
    assert "does not match the crc32 checksum" in line and "diverged" not in line, line
    assert "--step N reads an older step (available: [1, 2])" in line
    assert snapshot(run) == before
