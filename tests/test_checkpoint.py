"""Checkpointer round trips, retention, mismatch and corruption errors, atomicity, SIGTERM."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab.runs.checkpoint import Checkpointer, CheckpointError, PreemptionGuard

TMP_SUFFIX = ".orbax-checkpoint-tmp"


def make_state(step: int) -> dict:
    """A small training-state pytree whose values depend on ``step``."""
    params = {
        "embed": {"table_VD": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + step},
        "norm": {"scale_D": jnp.full((4,), 0.5 + step, dtype=jnp.bfloat16)},
        "head": {"count": jnp.asarray([step, 2 * step], dtype=jnp.int32)},
    }
    return {
        "params": params,
        "opt": optax.adamw(1e-3).init(params),
        "step": jnp.asarray(step, dtype=jnp.int32),
        "key": jax.random.key_data(jax.random.fold_in(jax.random.key(0), step)),
    }


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def assert_bitwise_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(
            np.asarray(g).reshape(-1).view(np.uint8),
            np.asarray(w).reshape(-1).view(np.uint8),
            strict=True,
        )


def listing(path: pathlib.Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*"))


def test_round_trip_is_bitwise(tmp_path):
    state = make_state(7)
    assert state["key"].dtype == jnp.uint32
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(7, state)
        restored = ckpt.restore(abstract(state))
    assert_bitwise_equal(restored, state)
    with Checkpointer(tmp_path) as ckpt:  # a fresh process sees the same thing
        assert_bitwise_equal(ckpt.restore(state, step=7), state)


def test_keeps_last_k_and_restores_older(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            assert ckpt.save(step, make_state(step))
        assert ckpt.save(4, make_state(99), force=True) is False  # existing step untouched
        assert ckpt.save(3, make_state(3)) is False  # not newer than the latest
        assert ckpt.all_steps() == [3, 4]
        assert ckpt.latest_step() == 4
        assert_bitwise_equal(ckpt.restore(abstract(make_state(0)), step=3), make_state(3))
        assert_bitwise_equal(ckpt.restore(abstract(make_state(0))), make_state(4))
        with pytest.raises(CheckpointError, match=r"step 1 .*available steps: \[3, 4\]"):
            ckpt.restore(abstract(make_state(0)), step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]


def test_empty_directory_raises(tmp_path):
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointError, match="no finalised"):
        ckpt.restore(abstract(make_state(0)))


def test_mismatches_name_the_leaf(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, make_state(1))
        target = abstract(make_state(1))

        wrong_shape = jax.tree.map(lambda x: x, target)
        wrong_shape["params"]["embed"]["table_VD"] = jax.ShapeDtypeStruct((5, 4), jnp.float32)
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(wrong_shape)
        message = str(info.value)
        assert "params/embed/table_VD" in message
        assert "(3, 4)" in message and "(5, 4)" in message
        assert "different model config" in message and "--workdir" in message
        assert str(tmp_path) in message and "step 1" in message

        wrong_dtype = jax.tree.map(lambda x: x, target)
        wrong_dtype["step"] = jax.ShapeDtypeStruct((), jnp.float32)
        with pytest.raises(CheckpointError, match=r"'step' .*int32.*float32"):
            ckpt.restore(wrong_dtype)

        missing = jax.tree.map(lambda x: x, target)
        del missing["params"]["norm"]
        with pytest.raises(CheckpointError, match="'params/norm/scale_D'.*not in the target"):
            ckpt.restore(missing)

        extra = jax.tree.map(lambda x: x, target)
        extra["params"]["new"] = jax.ShapeDtypeStruct((2,), jnp.float32)
        with pytest.raises(CheckpointError, match="'params/new' is absent from the checkpoint"):
            ckpt.restore(extra)


def _garble(path: pathlib.Path) -> None:
    size = path.stat().st_size
    path.write_bytes(b"\x5a" * size)


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# When one array fails to read, orbax abandons the sibling reads of the same restore and their
# late callbacks hit a closed event loop; that noise is orbax's, the error itself is checked.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: [_garble(f) for f in (d / "state" / "d").iterdir()], id="garbled"),
        pytest.param(
            lambda d: [_truncate(f) for f in (d / "state" / "d").iterdir()], id="truncated"
        ),
        pytest.param(lambda d: (d / "state" / "_METADATA").write_text("{no"), id="bad-json"),
        pytest.param(lambda d: (d / "state" / "manifest.ocdbt").unlink(), id="missing-file"),
        pytest.param(lambda d: shutil.rmtree(d / "state"), id="missing-item"),
    ],
)
def test_corrupt_checkpoint_is_reported_and_kept(tmp_path, damage):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, make_state(1), metadata={"run": 1})
        ckpt.save(2, make_state(2), metadata={"run": 2})
    newest = tmp_path / "2"
    damage(newest)
    before = listing(newest)

    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 2
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(abstract(make_state(0)))
        assert str(tmp_path) in str(info.value) and "step 2" in str(info.value)
        assert listing(newest) == before
        assert_bitwise_equal(ckpt.restore(abstract(make_state(0)), step=1), make_state(1))
        assert ckpt.restore_metadata(step=1) == {"run": 1}
    assert listing(newest) == before


def test_interrupted_save_is_invisible(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, make_state(1))
        ckpt.save(2, make_state(2))
    # What a save killed before its final rename leaves behind: an unrenamed, uncommitted copy.
    leftover = tmp_path / f"3{TMP_SUFFIX}"
    shutil.copytree(tmp_path / "2", leftover)
    (leftover / "commit_success.txt").unlink()
    _truncate(next((leftover / "state" / "d").iterdir()))

    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1, 2]
        assert ckpt.latest_step() == 2
        assert_bitwise_equal(ckpt.restore(abstract(make_state(0))), make_state(2))
        assert ckpt.save(3, make_state(3))  # the retried save replaces the leftover
        assert_bitwise_equal(ckpt.restore(abstract(make_state(0))), make_state(3))
    assert not leftover.exists()


def test_metadata_round_trip(tmp_path):
    config = {"model": {"d_model": 64, "heads": [4, 1]}, "lr": 3e-4, "name": "tiny", "ok": True}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, make_state(5), metadata=config)
        ckpt.save(6, make_state(6))
        assert ckpt.restore_metadata(step=5) == config
        assert ckpt.restore_metadata() == {}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore_metadata(5) == config


def test_guard_sets_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.requested
        signal.raise_signal(signal.SIGTERM)
        assert guard.requested and guard.signal_name == "SIGTERM"
        signal.raise_signal(signal.SIGINT)
        assert guard.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


TRAIN_LOOP = textwrap.dedent(
    """
    import itertools, sys, time
    import numpy as np
    from attnlab.runs.checkpoint import Checkpointer, PreemptionGuard

    with Checkpointer(sys.argv[1], max_to_keep=2) as ckpt, PreemptionGuard() as guard:
        for step in itertools.count(1):
            state = {"step": np.asarray(step, np.int32), "w": np.full((4,), step, np.float32)}
            stop = guard.requested
            if stop or step % 5 == 0:
                ckpt.save(step, state)
            if step == 1:
                print("ready", flush=True)
            if stop:
                print(f"stopped by {guard.signal_name} at {step}", flush=True)
                break
            time.sleep(0.01)
    """
)


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAIN_LOOP, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    last = int(out.split()[-1])
    assert out.strip() == f"stopped by SIGTERM at {last}"

    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == last
        target = {
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "w": jax.ShapeDtypeStruct((4,), jnp.float32),
        }
        restored = ckpt.restore(target)
    assert int(restored["step"]) == last
    np.testing.assert_array_equal(restored["w"], np.full((4,), last, np.float32))


def test_per_layer_checkpoint_is_refused_by_a_stacked_model(tmp_path):
    """A checkpoint of the per-layer layout (layers/0, layers/1) never restores into the
    stacked layout, even where the shapes could be made to line up."""
    per_layer = {"params": {"layers": {str(i): {"w_DD": jnp.full((2, 2), i)} for i in range(2)}}}
    stacked = {"params": {"layers": {"w_DD": jnp.zeros((2, 2, 2))}}}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, per_layer)
        before = listing(tmp_path)
        with pytest.raises(CheckpointError, match=r"parameters per layer.*new --workdir"):
            ckpt.restore(abstract(stacked))
        assert listing(tmp_path) == before
        restored = ckpt.restore(abstract(per_layer))  # the same layout still restores
        assert_bitwise_equal(restored, per_layer)
