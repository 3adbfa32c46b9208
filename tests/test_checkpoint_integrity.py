"""Checkpoint checksums: every file of a step's items is recorded at save and compared before a
restore, so a flipped bit anywhere is reported as corruption naming the file, and a resumed
run moves that step aside and restores the newest good one."""

import json
import pathlib
import shutil
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab.runs.checkpoint import Checkpointer, CorruptCheckpointError
from attnlab.runs.files import restore_newest

ITEMS = ("state", "metadata")


def make_state(step: int) -> dict:
    """Parameters and Adam's moments large enough (24 KiB) to be stored in Orbax's data files
    rather than inline in its tree nodes, with values that depend on ``step``."""
    params = {
        "w_DF": jax.random.normal(jax.random.key(step), (64, 96)),
        "b_F": jnp.linspace(-1.0, 1.0, 96) + step,
    }
    opt = optax.adam(1e-2)
    grads = jax.tree.map(jnp.cos, params)
    _, opt_state = opt.update(grads, opt.init(params), params)
    return {"params": params, "opt_state": opt_state, "step": jnp.asarray(step, jnp.int32)}


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def assert_bitwise_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(
            np.asarray(g).reshape(-1).view(np.uint8), np.asarray(w).reshape(-1).view(np.uint8)
        )


def item_files(step_dir: pathlib.Path) -> list[str]:
    return sorted(
        p.relative_to(step_dir).as_posix()
        for item in ITEMS
        for p in (step_dir / item).rglob("*")
        if p.is_file()
    )


def flip_bit(path: pathlib.Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(where * (len(data) - 1))] ^= 0x08
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    """Steps 1 and 2, saved once; tests copy the directory before damaging it."""
    directory = tmp_path_factory.mktemp("integrity") / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, make_state(1), metadata={"run": 1})
        ckpt.save(2, make_state(2), metadata={"run": 2})
    return directory


@pytest.fixture
def ckpt_dir(saved, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(saved, tmp_path / "ckpt"))


def test_every_file_of_the_items_is_recorded_with_its_size_and_crc32(saved):
    step = saved / "2"
    record = json.loads((step / "checksums.json").read_text())
    assert record["algorithm"] == "crc32"
    assert sorted(record["files"]) == item_files(step)
    kinds = {name.split("/d/")[0] for name in record["files"] if "/d/" in name}
    assert kinds == {"state", "state/ocdbt.process_0"}  # the merged tree's and the writer's
    for name, (size, digest) in record["files"].items():
        data = (step / name).read_bytes()
        assert (size, digest) == (len(data), f"{zlib.crc32(data):08x}"), name
    with Checkpointer(saved) as ckpt:  # the record's marker stays out of the caller's dict
        assert ckpt.restore_metadata(2) == {"run": 2}


def test_a_flipped_bit_in_any_file_is_named(saved, tmp_path):
    """Each file Orbax writes for the step: the values' data files (parameters and optimizer
    state together), the tree nodes, manifests, tree metadata, sharding, array metadata and
    the JSON metadata; the largest data file (the values) at its start, middle and end."""
    names = item_files(saved / "2")
    largest = max(names, key=lambda n: (saved / "2" / n).stat().st_size)
    cases = [(name, 0.5) for name in names] + [(largest, 0.0), (largest, 1.0)]
    for i, (name, where) in enumerate(cases):
        directory = pathlib.Path(shutil.copytree(saved, tmp_path / str(i)))
        flip_bit(directory / "2" / name, where)
        with Checkpointer(directory) as ckpt, pytest.raises(CorruptCheckpointError) as info:
            ckpt.verify(2)
        message = str(info.value)
        assert "\n" not in message and f"step 2 in {directory}" in message, message
        assert f"is corrupt: {name} does not match the crc32 checksum" in message, message
        assert "--step N reads an older step (available: [1])" in message


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_resume_moves_the_corrupt_step_aside_and_restores_the_previous_one(ckpt_dir, capsys):
    names = item_files(ckpt_dir / "2")
    values = max(names, key=lambda n: (ckpt_dir / "2" / n).stat().st_size)
    flip_bit(ckpt_dir / "2" / values)
    damaged = (ckpt_dir / "2" / values).read_bytes()
    with Checkpointer(ckpt_dir) as ckpt:
        all_finite = lambda p: all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(p))
        state, step = restore_newest(
            ckpt, abstract(make_state(0)), ckpt.all_steps(), all_finite, move_aside=True
        )
        assert step == 1 and ckpt.all_steps() == [1]
        assert_bitwise_equal(state, make_state(1))
        assert ckpt.restore_metadata(1) == {"run": 1}
    err = capsys.readouterr().err
    assert f"checkpoint step 2 in {ckpt_dir} is unreadable or corrupt ({values} does" in err
    assert "moved to step_2.corrupt; using checkpoint step 1 instead" in err
    assert (ckpt_dir / "step_2.corrupt" / values).read_bytes() == damaged  # kept as it was


def test_a_missing_record_is_corruption_and_a_step_saved_without_checksums_restores(ckpt_dir):
    (ckpt_dir / "2" / "checksums.json").unlink()  # as a process killed after orbax's rename
    with Checkpointer(ckpt_dir) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.restore(abstract(make_state(0)), 2)
    assert "is corrupt: checksums.json is missing" in str(info.value)
    with Checkpointer(ckpt_dir, checksum=None) as ckpt:  # as steps written before checksums
        ckpt.save(3, make_state(3), metadata={"run": 3})
        assert not (ckpt_dir / "3" / "checksums.json").exists()
        assert_bitwise_equal(ckpt.restore(abstract(make_state(0)), 3), make_state(3))
        assert ckpt.restore_metadata(3) == {"run": 3}


def copy_run(src: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    run = pathlib.Path(shutil.copytree(src, tmp_path / "run"))
    (run / "lock").unlink(missing_ok=True)
    return run


def values_file(step_dir: pathlib.Path) -> str:
    """The largest data file of a step (the parameters' and optimizer state's values)."""
    names = item_files(step_dir)
    return max(names, key=lambda n: (step_dir / n).stat().st_size)


def train(capsys, run: pathlib.Path, *args) -> tuple[int, str]:
    from attnlab.cli import main

    capsys.readouterr()
    argv = ["train", "--no-progress", "--config", run / "config.json", "--workdir", run, *args]
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


@pytest.mark.slow(reason="resumes the shared tiny run (trains a step) twice")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("step", [None, 2], ids=["default-resume", "--step-2"])
def test_a_resumed_run_moves_a_corrupt_newer_step_aside(tiny_lm_run, tmp_path, capsys, step):
    """Step 3 of the tiny run has a flipped bit: the default resume and ``--step 2`` both
    restore step 2, move step 3 to ``step_3.corrupt/`` as it was, and write a new step 3
    (``--step 2`` used to delete the damaged step and write over it)."""
    run = copy_run(tiny_lm_run, tmp_path)
    checkpoints = run / "checkpoints"
    name = values_file(checkpoints / "3")
    flip_bit(checkpoints / "3" / name)
    damaged = (checkpoints / "3" / name).read_bytes()
    rc, err = train(capsys, run, *([] if step is None else ["--step", step]))
    used = "using checkpoint step 2 instead" if step is None else "resuming from --step 2"
    assert rc == 0, err
    assert f"checkpoint step 3 in {checkpoints} is unreadable or corrupt ({name} does" in err
    assert f"moved to step_3.corrupt; {used}" in err, err
    assert (checkpoints / "step_3.corrupt" / name).read_bytes() == damaged
    with Checkpointer(checkpoints) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
        ckpt.verify(3)  # the new step 3, written by the resumed run
        assert ckpt.restore_metadata(3)["step"] == 3
