"""Bad invocations of the `attnlab` command: one line on stderr, the right exit code, and no
file written or changed."""

import pathlib
import shutil

import pytest
from run_checks import TINY, call_cli

from attnlab.cli import main


def snapshot(root: pathlib.Path) -> dict:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def place(tiny_lm_run, tmp_path):
    """Data files and a finished run (step 3 garbled in ``corrupt``) for the table below."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 200)
    (tmp_path / "short.txt").write_text("def f(): pass\n")
    (tmp_path / "a_file").write_text("not a directory")
    shutil.copytree(tiny_lm_run, tmp_path / "run")
    shutil.copytree(tiny_lm_run, tmp_path / "corrupt")
    for f in (tmp_path / "corrupt" / "checkpoints" / "3" / "state" / "d").iterdir():
        f.write_bytes(b"\x5a" * f.stat().st_size)
    return tmp_path


TRAIN = ["train", "--config", TINY, "--workdir", "{new}"]
# (what, argv, exit code, a word the message must hold); {p} is the fixture's directory.
BAD = [
    ("empty data file", [*TRAIN, "--config.data.path={p}/empty.txt"], 2, "is empty"),
    ("non-UTF-8 data file", [*TRAIN, "--config.data.path={p}/latin1.txt"], 2, "UTF-8"),
    ("missing data file", [*TRAIN, "--config.data.path={p}/nope.txt"], 2, "data.path"),
    ("too short a text", [*TRAIN, "--config.data.path={p}/short.txt"], 2, "data.seq_len"),
    ("misspelled variant", ["train", "--config", TINY + "y", "--workdir", "{new}"], 2, "tiny"),
    ("b2 above one", [*TRAIN, "--config.optim.b2=1.5"], 2, "optim.b2"),
    ("NaN epsilon", [*TRAIN, "--config.optim.eps=nan"], 2, "optim.eps"),
    ("negative scale", [*TRAIN, "--config.model.init_std=-1.0"], 2, "model.init_std"),
    ("unknown key", [*TRAIN, "--config.optim.lr=0.1"], 2, "optim.lr"),
    ("unknown flag", [*TRAIN, "--lr", "0.1"], 2, "--lr"),
    ("workdir is a file", ["train", "--config", TINY, "--workdir", "{p}/a_file"], 2, "a_file"),
    ("unwritable workdir", ["train", "--config", TINY, "--workdir", "/proc/attnlab"], 2, "/proc"),
    ("bad temperature", ["sample", "--workdir", "{p}/run", "--temperature", "-1"], 2, "--temp"),
    ("bad top-p", ["sample", "--workdir", "{p}/run", "--top-p", "1.5"], 2, "--top-p"),
    (
        "overflowing sample",
        ["sample", "--workdir", "{p}/run", "--max-new-tokens", "99", "--on-overflow", "raise"],
        2,
        "--max-new-tokens",
    ),
    ("unknown character", ["sample", "--workdir", "{p}/run", "--prompt", "\u2603"], 2, "--prompt"),
    ("not a work directory", ["eval", "--workdir", "{p}/nothing"], 2, "config.json"),
    ("missing step", ["eval", "--workdir", "{p}/run", "--step", "7"], 1, "--step 7"),
    ("corrupt checkpoint", ["eval", "--workdir", "{p}/corrupt", "--step", "3"], 1, "step 3"),
    ("plot of nothing", ["plot", "{p}/nothing", "--out", "{p}/x.png"], 2, "metrics.jsonl"),
]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_bad_invocations_print_one_line_and_change_nothing(place, capsys, monkeypatch):
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)
    before = snapshot(place)
    for what, argv, code, word in BAD:
        args = [a.format(p=place, new=place / "new") for a in argv]
        rc, out, err = call_cli(capsys, args)
        lines = err.strip().splitlines()
        assert rc == code, (what, rc, err)
        assert len(lines) == 1 and "Traceback" not in err, (what, err)
        assert lines[0].startswith("attnlab") and word in lines[0], (what, lines[0])
        assert out == "", (what, out)
        assert snapshot(place) == before, what


def test_debug_shows_the_traceback(place, capsys, monkeypatch):
    from attnlab.errors import ConfigError

    argv = ["train", "--config", TINY + "y", "--workdir", str(place / "new")]
    with pytest.raises(ConfigError):
        main([*argv, "--debug"])
    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(argv)
