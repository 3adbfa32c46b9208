"""A save the process died in (orbax finalised the step, its checksums were never written)
is undone on resume, not reported as corruption: the newest such steps move to
``step_N.corrupt/`` in one warning line and the run resumes from the newest finished step,
or starts from step 0 when there is none, continuing exactly as if never stopped."""

import shutil

import jax
import numpy as np
import pytest
from test_checkpoint_integrity import abstract, copy_run, make_state, train

from attnlab.runs.checkpoint import Checkpointer, UnfinishedCheckpointError
from attnlab.runs.files import set_aside_unfinished


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("unfinished", "left"), [((3,), [1, 2]), ((1, 2, 3), [])])
def test_the_newest_unfinished_saves_move_aside(tmp_path, capsys, unfinished, left):
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, make_state(step), metadata={"run": step})
    for step in unfinished:
        (directory / str(step) / "checksums.json").unlink()
    with Checkpointer(directory) as ckpt:
        with pytest.raises(UnfinishedCheckpointError, match="the save did not finish"):
            ckpt.verify(3)
        assert set_aside_unfinished(ckpt, ckpt.all_steps()) == left
        assert ckpt.all_steps() == left
    err = capsys.readouterr().err.strip()
    steps = ", ".join(map(str, sorted(unfinished, reverse=True)))
    assert err.startswith(f"attnlab: warning: the save of checkpoint step {steps} in {directory}")
    assert err.endswith("resuming from step 2" if left else "starting from step 0"), err
    assert "\n" not in err
    assert all((directory / f"step_{s}.corrupt").is_dir() for s in unfinished)


def test_an_older_step_without_its_record_is_not_taken_for_an_unfinished_save(tmp_path):
    """Only the newest steps can be a save in progress: a finished step 3 above a step 2
    that lost its record leaves both in place (restoring step 2 reports the corruption)."""
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        for step in (2, 3):
            ckpt.save(step, make_state(step))
    (directory / "2" / "checksums.json").unlink()
    with Checkpointer(directory) as ckpt:
        assert set_aside_unfinished(ckpt, ckpt.all_steps()) == [2, 3]
        with pytest.raises(UnfinishedCheckpointError):
            ckpt.restore(abstract(make_state(0)), 2)


@pytest.mark.slow(reason="resumes the shared tiny run, training two steps again")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_run_killed_in_its_last_two_saves_resumes_from_the_first_exactly(
    tiny_lm_run, tmp_path, capsys
):
    run = copy_run(tiny_lm_run, tmp_path)
    checkpoints = run / "checkpoints"
    for step in (2, 3):
        (checkpoints / str(step) / "checksums.json").unlink()
    rc, err = train(capsys, run)
    assert rc == 0, err
    assert "did not finish (its checksums were never written); moved to step_3.corrupt, " in err
    assert "step_2.corrupt; resuming from step 1" in err
    reference = tmp_path / "reference"
    shutil.copytree(tiny_lm_run / "checkpoints", reference)
    with Checkpointer(checkpoints) as new, Checkpointer(reference) as old:
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), old.stored_tree(3))
        got, want = new.restore(target, 3), old.restore(target, 3)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
