"""Divergence, token-id checks, work-directory safety, checkpoint fallback, resume changes and
config domains: each test pins one way a run used to go wrong quietly."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import run_checks

from attnlab import ModelConfig, build_model, experiment, runs
from attnlab.cli import main
from attnlab.errors import ConfigError, DecodeError, DivergenceError
from attnlab.runs.checkpoint import Checkpointer
from attnlab.runs.workdir import Lock
from attnlab.train import Trainer, lr_multiplier

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
QUIET = ["--config.eval.batches=0", "--config.eval.sample_tokens=0"]


def tiny(*overrides):
    return experiment.load_config(TINY, [*QUIET, *overrides])


def copy_run(src, tmp_path) -> pathlib.Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    (dst / "lock").unlink(missing_ok=True)
    return dst


def cli(capsys, *argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("attnlab: warning")]
    assert len(lines) == 1 and lines[0].startswith("attnlab ") and "Traceback" not in err, err
    return lines[0]


def restore_params(workdir, step):
    cfg = runs.saved_config(workdir)
    trainer = Trainer(cfg)
    with Checkpointer(workdir / "checkpoints") as ckpt:
        return ckpt.restore(trainer.abstract_state(), step), trainer


def test_divergence_stops_before_a_bad_checkpoint_and_keeps_the_last_good_one(tmp_path):
    # Logs every 6 steps, checkpoints every step keeping one: the old loop noticed the NaN
    # only at the log line and had rotated every finite checkpoint away by then.
    cfg = tiny(
        "--config.optim.learning_rate=1e30",
        "--config.optim.warmup_steps=0",
        "--config.train.steps=6",
        "--config.train.log_every_steps=6",
        "--config.checkpoint.every_steps=1",
        "--config.checkpoint.max_to_keep=1",
    )
    with pytest.raises(DivergenceError, match=r"at step (\d+).*last good checkpoint is step") as e:
        runs.train(cfg, tmp_path, progress=False)
    message = str(e.value)
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        (kept,) = ckpt.all_steps()
    assert f"step {kept} in" in message and "\n" not in message
    state, trainer = restore_params(tmp_path, kept)
    assert bool(trainer.all_finite(state["params"]))
    assert int(state["acc"]["nonfinite"]) == 0


@pytest.mark.slow(reason="trains a diverging run again; the stop mode is in the fast tier")
def test_skip_mode_skips_non_finite_steps_and_counts_them(tmp_path):
    cfg = tiny(
        "--config.optim.learning_rate=1e30",
        "--config.optim.warmup_steps=0",
        "--config.train.steps=4",
        "--config.train.on_nonfinite=skip",
        "--config.checkpoint.every_steps=2",
    )
    runs.train(cfg, tmp_path, progress=False)
    records = run_checks.records(tmp_path)
    assert sum(r["skipped_steps"] for r in records) >= 1
    assert all(np.isfinite(r["train_loss"]) for r in records)
    state, trainer = restore_params(tmp_path, 4)
    assert bool(trainer.all_finite(state["params"]))


def test_eval_and_sample_refuse_non_finite_parameters(tiny_lm_run, tmp_path, capsys):
    run = copy_run(tiny_lm_run, tmp_path)
    state, _ = restore_params(run, 3)
    state["params"] = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), state["params"])
    with Checkpointer(run / "checkpoints", max_to_keep=5) as ckpt:
        ckpt.save(4, state)
    for argv in (["eval"], ["sample", "--max-new-tokens", "3"]):
        rc, out, err = cli(capsys, *argv, "--workdir", run)
        assert rc == 1 and out == ""
        assert "non-finite" in one_error_line(err) and "--step" in err
    rc, out, _ = cli(capsys, "eval", "--workdir", run, "--step", "3")
    assert rc == 0 and json.loads(out)["step"] == 3


def test_the_model_call_checks_token_ids():
    cfg = ModelConfig(arch="decoder", vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_len=8)
    model = build_model(cfg, seed=0)
    for bad in (16, -1):
        with pytest.raises(DecodeError, match=f"token id {bad} at index"):
            model(jnp.array([[1, bad]]))
    from flax import nnx

    graphdef, params = nnx.split(model)
    logits = jax.jit(lambda p, ids: nnx.merge(graphdef, p)(ids).logits)
    nan_B = jnp.isnan(logits(params, jnp.array([[1, -1], [1, 16], [1, 15]]))).any(axis=(1, 2))
    assert nan_B.tolist() == [True, True, False]


def test_a_failed_start_writes_nothing_and_the_corrected_rerun_runs(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("abc")
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    for workdir in (fresh, existing):
        rc, _, err = cli(capsys, "train", "--config", TINY, "--workdir", workdir,
                         f"--config.data.path={text}", *QUIET)  # fmt: skip
        assert rc == 2 and "data.seq_len" in one_error_line(err)
    assert not fresh.exists() and list(existing.iterdir()) == []
    rc, _, err = cli(capsys, "train", "--no-progress", "--config", TINY, "--workdir", existing,
                     "--config.train.steps=1", *QUIET)  # fmt: skip
    assert rc == 0, err


def test_an_unknown_variant_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown variant 'tinyy'.*'tiny'"):
        experiment.load_config(TINY + "y")


@pytest.mark.parametrize(
    "override",
    [
        "optim.b2=1.5",
        "optim.b1=-0.1",
        "optim.eps=nan",
        "optim.learning_rate=inf",
        "optim.weight_decay=-1.0",
        "optim.clip_norm=-1.0",
        "data.val_fraction=1.0",
        "data.mask_rate=0.0",
        "eval.sample_temperature=-1.0",
        "train.on_nonfinite=ignore",
    ],
)
def test_numeric_fields_have_domains(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=.*--config\.{key}="):
        experiment.validate(experiment.load_config(TINY, [f"--config.{override}"]))


def test_a_changed_value_on_resume_is_refused_or_applied(tiny_lm_run, tmp_path, capsys):
    run = copy_run(tiny_lm_run, tmp_path)
    saved = (run / "config.json").read_text()
    argv = ["train", "--no-progress", "--config", run / "config.json", "--workdir", run]
    argv += ["--config.optim.learning_rate=0.01", "--config.train.steps=5"]
    rc, _, err = cli(capsys, *argv)
    line = one_error_line(err)
    assert rc == 2 and "optim.learning_rate" in line and "train.steps" in line
    assert "--allow-changes" in line and (run / "config.json").read_text() == saved
    rc, _, err = cli(capsys, *argv, "--allow-changes")
    assert rc == 0, err
    last = run_checks.records(run)[-1]
    cfg = runs.saved_config(run)
    assert cfg.optim.learning_rate == 0.01 and last["step"] == 5
    want = 0.01 * float(lr_multiplier(cfg.optim, 5)(4))
    np.testing.assert_allclose(last["learning_rate"], want, rtol=1e-6)


def test_a_second_process_is_refused_and_a_stale_lock_is_not(tiny_lm_run, tmp_path, capsys):
    run = copy_run(tiny_lm_run, tmp_path)
    argv = ["train", "--no-progress", "--config", run / "config.json", "--workdir", run]
    lock = Lock(run)
    try:
        rc, _, err = cli(capsys, *argv)
        assert rc == 2 and "in use by another attnlab process (pid" in one_error_line(err)
    finally:
        lock.release()
    assert not (run / "lock").exists()  # a run that ends removes its lock
    (run / "lock").write_text("pid 999999 on gone\n")  # left behind, as by a killed process
    rc, out, err = cli(capsys, *argv)
    last = run_checks.records(run)[-1]
    assert rc == 0 and last["step"] == 3 and "holds step 3 of 3" in out, err


@pytest.mark.parametrize("where", ["workdir", "checkpoints"])
def test_a_file_where_a_directory_is_expected_fails_at_once(tmp_path, capsys, where):
    workdir = tmp_path / "run"
    if where == "checkpoints":
        workdir.mkdir()
    (tmp_path / "run" / "checkpoints" if where == "checkpoints" else workdir).write_text("x")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, _, err = cli(capsys, "train", "--config", TINY, "--workdir", workdir, *QUIET)
    assert rc == 2 and "is a file, not a directory" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def garble(checkpoint_dir: pathlib.Path):
    for f in (checkpoint_dir / "state" / "d").iterdir():
        f.write_bytes(b"\x5a" * f.stat().st_size)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_newest_checkpoint_falls_back_and_step_picks(tiny_lm_run, tmp_path, capsys):
    run = copy_run(tiny_lm_run, tmp_path)
    garble(run / "checkpoints" / "3")
    rc, out, err = cli(capsys, "eval", "--workdir", run)
    assert rc == 0 and json.loads(out)["step"] == 2
    assert "checkpoint step 3 in" in err and "using checkpoint step 2" in err
    rc, _, err = cli(capsys, "eval", "--workdir", run, "--step", "3")
    assert rc == 1 and "step 3" in one_error_line(err) and "--step N" in err
    rc, _, err = cli(capsys, "train", "--no-progress", "--config", run / "config.json",
                     "--workdir", run)  # fmt: skip
    assert rc == 0 and "using checkpoint step 2" in err, err
    rc, out, err = cli(capsys, "eval", "--workdir", run)
    assert rc == 0 and json.loads(out)["step"] == 3 and "warning" not in err


def test_sample_uses_the_run_prompt_and_stops_at_the_context(tiny_lm_run, capsys):
    rc, out, err = cli(capsys, "sample", "--workdir", tiny_lm_run, "--max-new-tokens", "200")
    assert rc == 0 and out.startswith("def ") and 4 < len(out.rstrip("\n")) <= 32
    assert "context limit" in err and "model.max_len=32" in err
    rc, out, err = cli(capsys, "sample", "--workdir", tiny_lm_run, "--max-new-tokens", "200",
                       "--on-overflow", "raise")  # fmt: skip
    assert rc == 2 and out == "" and "--max-new-tokens 28 or less" in one_error_line(err)


def test_how_a_launch_finds_its_peers_is_not_a_change_of_run(tiny_lm_run, tmp_path):
    """Each process of one multi-host run carries its own process_id, and a resumed run may
    start on other hosts: none of that is a changed value the workdir refuses."""
    run = copy_run(tiny_lm_run, tmp_path)
    cfg = runs.saved_config(run)
    cfg.distributed.process_id = 1
    cfg.distributed.num_processes = 2
    cfg.distributed.coordinator_address = "localhost:1234"
    assert runs.workdir.config_changes(run, cfg) == []
    cfg.train.steps += 1
    assert runs.workdir.config_changes(run, cfg) == [
        f"train.steps: {cfg.train.steps - 1} -> {cfg.train.steps}"
    ]
