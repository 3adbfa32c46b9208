"""A run that cannot start says so before its first step, in one line, and leaves its work
directory as it was: each row below is one way to fail (the sample prompt against the
corpus, a missing optional package, a path in the way, a start that fails after the checks,
an empty prompt, sampled ids without text, Ctrl-C during the imports), with its exit status,
its line and the directory's contents before and after."""

import os
import pathlib
import signal
import subprocess
import sys
import time
import tomllib

import pytest

from attnlab.cli import main

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
TRAIN = ["train", "--config", TINY, "--no-progress", "--workdir", "{new}"]


def snapshot(root: pathlib.Path) -> dict:
    """Every path under ``root`` with its size and mtime (a folder: its presence)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def one_line(capsys, argv, code, words, place, began=False):
    """Runs ``attnlab argv`` in this process; asserts the status, one stderr line holding
    ``words``, nothing on stdout (but the header of a run that ``began``), and that
    ``place`` is unchanged."""
    before = snapshot(place)
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == code, (argv, rc, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]
    assert out == "" or began and out.startswith("run: "), out
    assert snapshot(place) == before, argv
    return lines[0]


@pytest.fixture
def place(tmp_path):
    # A corpus without the sample prompt's "f" ("def "), long enough for the tiny run.
    (tmp_path / "no_f.txt").write_text("abc de ghi jkl mno pqr stu vwx yz\n" * 200)
    (tmp_path / "old").mkdir()  # a work directory that holds something already
    (tmp_path / "old" / "notes.txt").write_text("mine")
    (tmp_path / "tb_file").mkdir()
    (tmp_path / "tb_file" / "tb").write_text("a file where the run writes a folder")
    (tmp_path / "config_dir").mkdir()
    (tmp_path / "config_dir" / "config.json").mkdir()
    return tmp_path


# (what, argv, hidden package, exit status, words the line must hold); {p}: the fixture's
# folder, {new}: a work directory that does not exist yet.
ROWS = [
    (
        "the sample prompt has a character the corpus lacks (it failed at the first log)",
        [*TRAIN, "--config.data.path={p}/no_f.txt"],
        None,
        2,
        ["eval.sample_prompt='def '", "'f'", "--config.eval.sample_tokens=0"],
    ),
    (
        "a sample prompt longer than the context",
        [*TRAIN, "--config.eval.sample_prompt=" + "x" * 40],
        None,
        2,
        ["eval.sample_prompt", "model.max_len=32"],
    ),
    (
        "hf_datasets without the datasets package",
        [*TRAIN, "--config.data.source=hf_datasets", "--config.data.path={p}/my.jsonl"],
        "datasets",
        2,
        ["data.source='hf_datasets'", 'pip install -e ".[datasets]"'],
    ),
    (
        "text data without Grain",
        TRAIN,
        "grain",
        2,
        ["data.kind='text'", "pip install -e . in"],
    ),
    (
        "Weights & Biases tracking without wandb",
        [*TRAIN, "--config.track.wandb_project=p"],
        "wandb",
        2,
        ["track.wandb_project='p'", 'pip install -e ".[cluster]"'],
    ),
    (
        "the harness without lm_eval",
        ["eval", "--harness", "x", "--workdir", "{p}/old"],
        "lm_eval",
        2,
        ["--harness", 'pip install -e ".[eval]"'],
    ),
    ("a file where tb/ goes", [*TRAIN[:-1], "{p}/tb_file"], None, 2, ["tb_file/tb", "folder"]),
    (
        "a folder where config.json goes",
        [*TRAIN[:-1], "{p}/config_dir"],
        None,
        2,
        ["config_dir/config.json", "is a folder"],
    ),
    ("an empty --prompt", ["sample", "--workdir", "{p}/old", "--prompt", ""], None, 2, []),
]


@pytest.mark.parametrize("what, argv, hidden, code, words", ROWS, ids=[r[0] for r in ROWS])
def test_a_start_that_cannot_run_is_one_line_and_writes_nothing(
    place, capsys, monkeypatch, what, argv, hidden, code, words
):
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)
    if hidden is not None:  # as if it were not installed: find_spec gives None, import fails
        monkeypatch.setitem(sys.modules, hidden, None)
    if "sample" in argv:  # the prompt is refused before the run is read
        words = ["--prompt is empty"]
        monkeypatch.setattr("attnlab.runs.load_run", lambda *a, **k: _fake_run())
    args = [a.format(p=place, new=place / "new") for a in argv]
    one_line(capsys, args, code, words, place)
    assert not (place / "new").exists()


def _fake_run():
    """A run whose model is never reached (the prompt is refused first)."""
    import types

    from attnlab.config import ModelConfig

    cfg = types.SimpleNamespace(eval=types.SimpleNamespace(sample_prompt="x"))
    mcfg = ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, max_len=8)
    task = types.SimpleNamespace(encode=lambda text: [1] * len(text), tokenizer=object())
    return types.SimpleNamespace(
        config=cfg, trainer=types.SimpleNamespace(mcfg=mcfg), task=task, model=None
    )


def test_run_generate_refuses_an_empty_prompt():
    from attnlab.errors import DecodeError
    from attnlab.runs.loading import Run

    run = Run(*([None] * 9))  # refused before anything of the run is read
    with pytest.raises(DecodeError, match="prompt is empty"):
        run.generate("")


def test_an_interrupt_while_the_command_starts_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr("attnlab.cli.build_parser", interrupted)
    assert main(["train"]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: stopped: SIGINT"), lines


def test_sigint_while_modules_load_is_held_not_raised():
    from attnlab.cli import _holding_sigint

    with _holding_sigint() as held:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):  # the handler runs between bytecodes
            if held:
                break
    assert held == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.slow(reason="a failed first step after the checks: compiles the tiny model (~4 s)")
def test_a_start_that_fails_after_the_checks_leaves_the_directory_as_it_was(
    place, capsys, monkeypatch
):
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)
    quiet = ["--config.eval.batches=0"]

    def stopped(self):
        raise KeyboardInterrupt  # Ctrl-C while the state is initialised

    # a --step the new directory cannot have: Run.begin has created it by then
    one_line(capsys, [*TRAIN, *quiet, "--step", "4"], 1, ["--step 4"], place)
    assert not (place / "new").exists()
    monkeypatch.setattr("attnlab.train.Trainer.init_state", stopped)
    for workdir in ("new", "old"):
        argv = [*TRAIN[:-1], str(place / workdir), *quiet]
        one_line(capsys, argv, 130, ["SIGINT"], place, began=True)
    assert not (place / "new").exists()
    assert sorted(os.listdir(place / "old")) == ["notes.txt"]


@pytest.mark.slow(reason="builds a data set with the datasets library and a run (~10 s)")
def test_a_corpus_of_ones_own_without_the_prompts_character(place, capsys, monkeypatch):
    """The reproduction as reported: hf_datasets on a JSON Lines file, the tiny char model."""
    pytest.importorskip("datasets")
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)
    monkeypatch.setenv("ATTNLAB_CACHE", str(place / "cache"))
    lines = [f'{{"text": "abc de ghi {i} jkl mno"}}' for i in range(400)]
    (place / "my.jsonl").write_text("\n".join(lines) + "\n")
    argv = [a.format(p=place, new=place / "new") for a in TRAIN]
    argv += ["--config.data.source=hf_datasets", f"--config.data.path={place / 'my.jsonl'}"]
    before = {k: v for k, v in snapshot(place).items() if not k.startswith("cache")}
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval.sample_prompt='def '" in err[0], err
    assert {k: v for k, v in snapshot(place).items() if not k.startswith("cache")} == before


@pytest.mark.slow(reason="samples from the shared tiny run (~3 s)")
def test_sample_says_how_many_sampled_ids_had_no_text(tiny_lm_run, capsys, tmp_path):
    before = snapshot(tiny_lm_run)
    n = 28  # what model.max_len=32 leaves after the prompt
    argv = ["sample", "--workdir", str(tiny_lm_run), "--prompt", "def "]
    assert main([*argv, "--max-new-tokens", str(n), "--temperature", "1.0"]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    lines = [line for line in lines if "stopping at the context limit" not in line]
    assert len(lines) == 1, err
    words = lines[0].split()
    unknown = int(words[2])  # "attnlab sample: K of the N sampled ids have no text ..."
    assert words[5] == str(n) and "model.vocab_size=256" in lines[0]
    assert 0 < unknown <= n
    # the char tokenizer gives one character per known id: the text is what is left
    assert len(out) - len("def ") - 1 == n - unknown
    assert snapshot(tiny_lm_run) == before


def _console_script() -> str:
    """The code pip writes for ``[project.scripts]``'s ``attnlab``."""
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = entry["attnlab"].split(":")
    return f"import sys; from {module} import {function}; sys.exit({function}())"


@pytest.mark.slow(reason="starts the command in a new interpreter (~4 s)")
def test_ctrl_c_during_the_imports_is_one_line_and_exit_130(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", _console_script(), *TRAIN]
    argv = [a.format(new=tmp_path / "new") for a in argv]
    child = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    maps = pathlib.Path(f"/proc/{child.pid}/maps")
    if not maps.exists():
        child.kill()
        pytest.skip("needs /proc to see the command's imports begin")
    try:  # once NumPy is mapped the command is inside its heavy imports
        while child.poll() is None and "numpy" not in maps.read_text():
            time.sleep(0.002)
    except FileNotFoundError:
        pass
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert child.returncode == 130, err
    assert len(lines) == 1 and "SIGINT" in lines[0], err
    assert not (tmp_path / "new").exists()
