"""Every failure a researcher can cause, on every command: exit status 2 for bad input (1 when
a run fails, 130/143 when a signal stops it), one line on stderr that names the input, what
was wrong and what to do, no traceback, and nothing in the directories lost or changed."""

import errno
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
import xla_flags

from attnlab.cli import main
from attnlab.data.prepared import prepare
from attnlab.errors import DecodeError, TokenIdError
from attnlab.runs.checkpoint import Checkpointer
from attnlab.runs.sample_command import _room

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
QUIET = ["--config.eval.batches=0", "--config.eval.sample_tokens=0"]
GPT2 = dict(model_type="gpt2", n_embd=8, n_layer=1, n_head=2, n_positions=16, vocab_size=10)


def snapshot(root: pathlib.Path, skip: str | None = None) -> dict:
    """Size and mtime of everything under ``root``, leaving out (unvisited) the folders whose
    names hold ``skip``."""
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if skip is None or skip not in d]
        for name in dirs + files:
            p = pathlib.Path(folder, name)
            out[str(p.relative_to(root))] = (p.stat().st_size, p.stat().st_mtime_ns)
    return out


def finalised(checkpoints: pathlib.Path) -> dict:
    """The finalised checkpoints alone: a failed save's ``-tmp`` folder is left out unvisited,
    since Orbax's background threads may still be removing files from it."""
    return snapshot(checkpoints, skip="checkpoint-tmp")


def copy(src: pathlib.Path, dst: pathlib.Path, *, drop=(), write=None) -> pathlib.Path:
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    for name, data in (write or {}).items():
        (dst / name).write_bytes(data)
    return dst


@pytest.fixture
def place(tiny_lm_run, tmp_path):
    """Inputs that are each wrong in one way (built in ~1 s on the shared tiny run)."""
    p = tmp_path
    (p / "text.txt").write_text("def f(x):\n    return x + 1\n" * 120)
    (p / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 200)
    (p / "a_file").write_text("not a directory")
    (p / "bad_tok.json").write_text('{"kind": "char", "chars": ')
    ok = p / "prep"
    prepare([p / "text.txt"], ok, tokenizer="char", val_fraction=0.2, progress=False)
    meta = json.loads((ok / "meta.json").read_text())
    tokens = (ok / "tokens.bin").read_bytes()
    copy(ok, p / "prep_no_meta", drop=["meta.json"])
    copy(ok, p / "prep_no_bin", drop=["tokens.bin"])
    copy(ok, p / "prep_cut", write={"tokens.bin": tokens[: len(tokens) // 2]})
    nanogpt = json.dumps({"vocab_size": 65, "itos": {}, "stoi": {}}).encode()
    copy(ok, p / "prep_foreign_meta", write={"meta.json": nanogpt})
    foreign = np.full(meta["tokens"], 60_000, np.dtype(meta["dtype"])).tobytes()
    copy(ok, p / "prep_foreign_ids", write={"tokens.bin": foreign})
    shutil.copytree(tiny_lm_run, p / "run_bad_tok")
    (p / "run_bad_tok" / "lock").unlink(missing_ok=True)
    (p / "run_bad_tok" / "tokenizer.json").write_text("{garbled")
    hf = {"config.json": json.dumps(GPT2).encode(), "tokenizer.json": b"{}"}
    for name, files in [
        ("hf_empty", {}),
        ("hf_no_config", {"tokenizer.json": b"{}"}),
        ("hf_no_weights", hf),
        ("hf_cut_weights", {**hf, "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{"}),
    ]:
        (p / name).mkdir()
        for file, data in files.items():
            (p / name / file).write_bytes(data)
    return p


TRAIN = ["train", "--no-progress", "--config", TINY, "--workdir", "{p}/new", *QUIET]
PREPARED = [*TRAIN, "--config.data.kind=prepared"]
PREPARE = ["data", "prepare", "--no-progress", "--tokenizer", "char"]
SAMPLE_HF = ["sample", "--prompt", "hi", "--max-new-tokens", "2", "--pretrained"]
# (case, argv, exit status, words the one line holds); {p} is the fixture's directory.
CASES = [
    ("prepare: missing input", [*PREPARE, "{p}/nope.txt", "--out", "{p}/o"], 2, ["nope.txt"]),
    ("prepare: not UTF-8", [*PREPARE, "{p}/latin1.txt", "--out", "{p}/o"], 2, ["UTF-8"]),
    ("prepare: --out a file", [*PREPARE, "{p}/text.txt", "--out", "{p}/a_file"], 2, ["a_file"]),
    (
        "prepare: corrupt tokenizer",
        ["data", "prepare", "{p}/text.txt", "--out", "{p}/o", "--tokenizer", "{p}/bad_tok.json"],
        2,
        ["bad_tok.json", "not readable JSON"],
    ),
    (
        "prepared: no meta.json",
        [*PREPARED, "--config.data.path={p}/prep_no_meta"],
        2,
        ["meta.json", "attnlab data prepare"],
    ),  # fmt: skip
    (
        "prepared: no tokens.bin",
        [*PREPARED, "--config.data.path={p}/prep_no_bin"],
        2,
        ["tokens.bin is missing"],
    ),  # fmt: skip
    (
        "prepared: truncated .bin",
        [*PREPARED, "--config.data.path={p}/prep_cut"],
        2,
        ["cut short", "attnlab data prepare"],
    ),  # fmt: skip
    (
        "prepared: foreign index",
        [*PREPARED, "--config.data.path={p}/prep_foreign_meta"],
        2,
        ["not written by", "attnlab data prepare"],
    ),  # fmt: skip
    (
        "prepared: ids past the vocabulary",
        [*PREPARED, "--config.data.path={p}/prep_foreign_ids"],
        2,
        ["id 60000", "tokenizer"],
    ),  # fmt: skip
    (
        "prepared: a text file",
        [*PREPARED, "--config.data.path={p}/text.txt"],
        2,
        ["not a directory"],
    ),  # fmt: skip
    (
        "train: corrupt data.tokenizer",
        [*TRAIN, "--config.data.tokenizer={p}/bad_tok.json"],
        2,
        ["bad_tok.json"],
    ),  # fmt: skip
    (
        "eval: corrupt run tokenizer",
        ["eval", "--workdir", "{p}/run_bad_tok"],
        2,
        ["tokenizer.json", "not readable"],
    ),  # fmt: skip
    (
        "sample: corrupt run tokenizer",
        ["sample", "--workdir", "{p}/run_bad_tok"],
        2,
        ["tokenizer.json"],
    ),  # fmt: skip
    ("pretrained: no folder", [*SAMPLE_HF, "{p}/nowhere"], 2, ["no checkpoint folder"]),
    ("pretrained: no tokenizer.json", [*SAMPLE_HF, "{p}/hf_empty"], 2, ["tokenizer.json"]),
    (
        "pretrained: no config.json",
        [*SAMPLE_HF, "{p}/hf_no_config"],
        2,
        ["config.json", "download"],
    ),  # fmt: skip
    (
        "pretrained: no weights",
        [*SAMPLE_HF, "{p}/hf_no_weights"],
        2,
        ["model.safetensors", "download"],
    ),  # fmt: skip
    (
        "pretrained: cut weights",
        [*SAMPLE_HF, "{p}/hf_cut_weights"],
        2,
        ["safetensors", "download it again"],
    ),  # fmt: skip
    (
        "fetch: offline",
        ["data", "fetch", "shakespeare", "--no-progress"],
        2,
        ["offline", "tinyshakespeare.txt"],
    ),  # fmt: skip
    ("fetch: unknown name", ["data", "fetch", "nosuch"], 2, ["unknown dataset", "shakespeare"]),
    (
        "fetch: no such file",
        ["data", "fetch", "file://{p}/nope.txt", "--sha256", "0" * 64],
        2,
        ["no such file"],
    ),  # fmt: skip
]


def _offline(url, *args, **kwargs):
    if str(url).startswith("http"):
        raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))
    return ORIGINAL_URLOPEN(url, *args, **kwargs)


ORIGINAL_URLOPEN = urllib.request.urlopen


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_each_bad_input_ends_in_one_line_and_changes_nothing(place, capsys, monkeypatch):
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)
    monkeypatch.setenv("ATTNLAB_CACHE", str(place / "cache"))
    monkeypatch.setattr(urllib.request, "urlopen", _offline)
    before = snapshot(place)
    for case, argv, code, words in CASES:
        capsys.readouterr()
        try:
            rc = main([a.format(p=place) for a in argv])
        except SystemExit as e:
            rc = e.code
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert rc == code, (case, rc, err)
        assert len(lines) == 1 and "Traceback" not in err, (case, err)
        assert lines[0].startswith("attnlab "), (case, lines[0])
        assert all(w in lines[0] for w in words), (case, lines[0])
        assert snapshot(place) == before, case


def test_a_learned_position_table_refuses_tokens_past_its_end():
    with pytest.raises(DecodeError, match=r"model.max_len=64 \(model.position='learned'"):
        _room(5000, 3, 64, None, "--prompt", "learned")
    assert _room(5000, 3, 64, "stop", "--prompt", "learned") == 61  # asked for explicitly
    assert _room(5000, 3, 64, None, "--prompt", "rope") == 61  # stops, with a note


def test_a_target_id_outside_the_vocabulary_is_a_data_error():
    from attnlab.data.text import token_task
    from attnlab.data.tokenizers import CharTokenizer

    ids = np.arange(400) % 5
    ids[200:] = 9  # past the 5-character vocabulary
    task = token_task({"seq_len": 8}, "prepared", CharTokenizer("abcde"), ids[:200], ids[200:])
    task.train_batch(0, 0, 2)  # training windows are fine
    with pytest.raises(TokenIdError, match=r"batch\['inputs'\]: id 9 .*attnlab data prepare"):
        task.eval_batches(2, 1)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_full_disk_while_checkpointing_keeps_the_last_step(tiny_lm_run, tmp_path, capsys):
    """The write fails part way (ENOSPC inside Orbax): one line naming the step kept, every
    earlier checkpoint intact and restorable (what orbax still writes of the failed step
    lies in a ``-tmp`` directory that is never read)."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    run = shutil.copytree(tiny_lm_run, tmp_path / "run")
    (run / "lock").unlink(missing_ok=True)
    checkpoints = finalised(run / "checkpoints")

    async def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    mp = pytest.MonkeyPatch()
    mp.setattr(handler.JsonCheckpointHandler, "_save_fn", no_space)
    try:
        capsys.readouterr()
        argv = ["train", "--no-progress", "--config", str(run / "config.json"), "--workdir"]
        rc = main([*argv, str(run), "--config.train.steps=4", "--allow-changes", *QUIET])
    finally:
        mp.undo()
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "no space left" in err and "step 3 is kept" in err and "same command" in err, err
    assert finalised(run / "checkpoints") == checkpoints
    with Checkpointer(run / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [1, 2, 3] and ckpt.restore_metadata(3)["step"] == 3


def test_ctrl_c_in_training_writes_the_checkpoint_and_exits_130(tmp_path, capsys, monkeypatch):
    from attnlab.data.tasks import Task

    batch = Task.train_batch

    def interrupting(self, seed, step, batch_size):
        if step == 1:  # while step 2 is prepared, as a user's Ctrl-C would arrive
            os.kill(os.getpid(), signal.SIGINT)
        return batch(self, seed, step, batch_size)

    monkeypatch.setattr(Task, "train_batch", interrupting)
    capsys.readouterr()
    argv = ["train", "--no-progress", "--config", TINY, "--workdir", str(tmp_path / "run")]
    rc = main([*argv, "--config.train.steps=50", *QUIET])
    out, err = capsys.readouterr()
    assert rc == 130, err
    assert err.strip().splitlines() == [err.strip()] and "SIGINT" in err and "resume" in err
    assert "stopped at step 2 (SIGINT)" in out
    with Checkpointer(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2]
        assert ckpt.restore_metadata(2)["interrupted"] == "SIGINT"


# A fresh process with 8 CPU devices: ~30 s of start-up and compilation on a 2-core machine.
@pytest.mark.slow
def test_eight_devices_evaluate_a_batch_they_cannot_split_and_sigterm_exits_143(tmp_path):
    """eval.batch_size=4 on a data axis of 8 is padded with masked rows (the same loss as on
    one device); SIGTERM once the first evaluation is logged writes the checkpoint, records
    ``interrupted`` and exits 143."""
    env = {**os.environ, "XLA_FLAGS": xla_flags.devices(8)}
    env.pop("ATTNLAB_DEBUG", None)
    argv = [sys.executable, "-m", "attnlab.cli", "train", "--no-progress", "--config", TINY]
    argv += ["--workdir", str(tmp_path / "run"), "--config.mesh.data=8"]
    argv += ["--config.train.batch_size=8", "--config.train.steps=100000"]
    argv += ["--config.eval.every_steps=2", "--config.checkpoint.every_steps=100000"]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        for line in proc.stdout:
            if "eval_loss" in line:
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert len(err.strip().splitlines()) == 1 and "SIGTERM" in err and "resume" in err, err
    with Checkpointer(tmp_path / "run" / "checkpoints") as ckpt:
        (step,) = ckpt.all_steps()
        assert step >= 2 and ckpt.restore_metadata(step)["interrupted"] == "SIGTERM"
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r and np.isfinite(r["eval_loss"]) for r in records)
