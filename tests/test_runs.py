"""The training loop, work directories, exact resumption and run loading."""

import json
import pathlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import run_checks
from tiers import cases

from attnlab import experiment, runs
from attnlab.errors import DataError

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny(name, *overrides):
    return experiment.load_config(f"{REPO / 'experiments' / name}:tiny", list(overrides))


def test_short_run_lowers_the_loss(tmp_path):
    cfg = tiny(
        "char_lm.py",
        "--config.train.steps=60",
        "--config.eval.every_steps=30",
        "--config.eval.sample_tokens=0",
        "--config.optim.learning_rate=0.01",
        "--config.optim.warmup_steps=5",
        "--config.train.log_every_steps=10",
        "--config.checkpoint.every_steps=60",
    )
    runs.train(cfg, tmp_path, progress=False)
    records = run_checks.records(tmp_path)
    first, last = records[0], records[-1]
    assert last["train_loss"] < first["train_loss"] - 1.0
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert evals[-1] < evals[0]
    for key in (
        "step",
        "train_loss",
        "eval_loss",
        "learning_rate",
        "grad_norm",
        "tokens_per_sec",
        "elapsed_sec",
    ):
        assert key in last
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 60


def test_the_train_step_compiles_once_across_logs_and_evaluations(tmp_path, caplog):
    """Resetting the accumulators at a log once committed part of the state, and the step
    compiled again for each new mix of committed arguments (three times in all)."""
    cfg = tiny(
        "char_lm.py",
        "--config.train.steps=6",
        "--config.train.log_every_steps=2",
        "--config.eval.every_steps=3",
        "--config.eval.sample_tokens=0",
        "--config.checkpoint.every_steps=6",
    )
    # "Compiling jit(...)" is logged for every compilation, persistent-cache hits included.
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        runs.train(cfg, tmp_path, progress=False)
    compiled = [
        r.getMessage()[:80]
        for r in caplog.records
        if "Compiling jit(_train_step)" in r.getMessage()
    ]
    assert len(compiled) == 1, compiled
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4  # steps 2, 3, 4, 6


DETERMINISTIC = ("step", "train_loss", "learning_rate", "grad_norm", "eval_loss", "eval_accuracy")


def _metrics(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in map(json.loads, lines)]


def _final_params(workdir, cfg):
    run = runs.load_run(workdir)
    return run.step, jax.tree.leaves(run.params)


@pytest.mark.parametrize(
    "stop", cases([3, 5], slow={5: "a second stopping point; 3 stops mid-window"})
)
def test_resume_is_exact(tmp_path, stop):
    overrides = [
        "--config.train.steps=8",
        "--config.eval.every_steps=4",
        "--config.eval.sample_tokens=0",
        "--config.train.log_every_steps=2",
        "--config.checkpoint.every_steps=4",
        "--config.model.dropout=0.1",
    ]
    cfg = tiny("char_lm.py", *overrides)
    runs.train(cfg, tmp_path / "straight", progress=False)
    runs.train(
        tiny("char_lm.py", *overrides), tmp_path / "resumed", progress=False, stop_after=stop
    )
    runs.train(tiny("char_lm.py", *overrides), tmp_path / "resumed", progress=False)
    assert _metrics(tmp_path / "straight") == _metrics(tmp_path / "resumed")
    s1, p1 = _final_params(tmp_path / "straight", cfg)
    s2, p2 = _final_params(tmp_path / "resumed", cfg)
    assert s1 == s2 == 8
    for a, b in zip(p1, p2, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sigterm_leaves_a_restorable_checkpoint(tmp_path):
    proc = run_checks.cli_process(
        "train",
        "--no-progress",
        "--config",
        run_checks.TINY,
        "--workdir",
        str(tmp_path),
        "--config.train.steps=100000",
        "--config.eval.every_steps=100000",
        "--config.checkpoint.every_steps=100000",
        "--config.train.log_every_steps=5",
    )
    for line in proc.stdout:
        if line.startswith("step=10 "):
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out  # 128 + SIGTERM: stopped, checkpoint written
    assert "SIGTERM" in out
    run = runs.load_run(tmp_path)
    params, step = run.params, run.step
    assert 10 <= step < 100000
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_vocabulary_larger_than_model_is_rejected(tmp_path):
    cfg = tiny("char_lm.py", "--config.model.vocab_size=10", "--config.model.pad_id=0")
    with pytest.raises(experiment.ExperimentError, match="model.vocab_size"):
        runs.train(cfg, tmp_path, progress=False)


def test_workdir_with_another_model_is_refused(tmp_path):
    cfg = tiny("char_lm.py", "--config.eval.sample_tokens=0")
    runs.train(cfg, tmp_path, progress=False)
    other = tiny("char_lm.py", "--config.model.d_model=48", "--config.eval.sample_tokens=0")
    with pytest.raises(experiment.ExperimentError, match="model.d_model"):
        runs.train(other, tmp_path, progress=False)


@pytest.mark.slow(
    reason="trains a run to reload its config; test_config checks the JSON round trip"
)
def test_saved_config_reloads_to_the_same_config(tmp_path):
    cfg = tiny("char_lm.py", "--config.model.n_kv_heads=1", "--config.eval.sample_tokens=0")
    runs.train(cfg, tmp_path, progress=False)
    again = experiment.load_config(str(tmp_path / "config.json"), ["--config.train.steps=9"])
    assert again.model.to_dict() == cfg.model.to_dict() and again.train.steps == 9


def test_eval_matches_manual_loss(tmp_path):
    cfg = tiny("char_lm.py", "--config.eval.sample_tokens=0")
    runs.train(cfg, tmp_path, progress=False)
    result = runs.evaluate(tmp_path)
    run = runs.load_run(tmp_path)
    trainer, task, params = run.trainer, run.task, run.params
    batch = task.eval_batches(int(cfg.eval.batch_size), 1)[0]
    logits = np.asarray(trainer.model(params)(jnp.asarray(batch["inputs"])).logits, np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    assert result["eval_loss"] == pytest.approx(nll.mean(), rel=1e-5)


def test_full_eval_scores_every_validation_token_once(tmp_path, capsys):
    """``eval --full``: the mean NLL over every target of the validation split (tail
    included), against each window run on its own and scored in float64 NumPy."""
    cfg = tiny("char_lm.py", "--config.eval.sample_tokens=0", "--config.data.val_fraction=0.02")
    runs.train(cfg, tmp_path, progress=False)
    from attnlab import cli

    assert cli.main(["eval", "--workdir", str(tmp_path), "--full"]) in (0, None)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = runs.load_run(tmp_path)
    trainer, task, params = run.trainer, run.task, run.params
    val, T = np.asarray(task.val_ids), int(cfg.data.seq_len)
    assert (len(val) - 1) % T, "the split should end in a partial window"
    model = trainer.model(params)
    nll = []
    for start in range(0, len(val) - 1, T):
        ids = val[start : start + T + 1]
        logits = np.asarray(model(jnp.asarray(ids[None, :-1])).logits[0], np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll.extend(-logp[np.arange(len(ids) - 1), ids[1:]])
    assert result["eval_tokens"] == len(val) - 1 == len(nll)
    assert result["eval_loss"] == pytest.approx(np.mean(nll), rel=1e-5)
    assert result["eval_loss"] != pytest.approx(runs.evaluate(tmp_path)["eval_loss"], rel=1e-4)


@pytest.mark.slow(reason="trains a run only to be refused; the full evaluation itself is fast-tier")
def test_full_eval_refuses_a_task_without_a_validation_split(tmp_path):
    cfg = tiny("reverse_seq2seq.py", "--config.eval.sample_tokens=0", "--config.train.steps=1")
    runs.train(cfg, tmp_path, progress=False)
    with pytest.raises(DataError, match="--full"):
        runs.evaluate(tmp_path, full=True)


def test_a_run_prints_a_header_and_a_summary_and_reopens_as_a_run(tmp_path, capsys):
    cfg = tiny("char_lm.py", "--config.train.steps=4", "--config.eval.every_steps=2")
    runs.train(cfg, tmp_path, progress=False)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"run: {tmp_path}"
    assert lines[1].startswith("model: decoder, ") and lines[1].endswith(" parameters")
    assert lines[2] == "training: 4 steps of 4 x 32 = 128 tokens per step"
    assert lines[3].startswith("data: text, CharTokenizer(") and "validation tokens" in lines[3]
    several = len(jax.devices()) > 1
    assert any(x.startswith("devices: ") for x in lines) == several
    assert any(x.startswith("mesh: ") for x in lines) == several
    assert not any(x.startswith(("  ", "per device")) for x in lines)  # --verbose shows them
    assert "eval_exact_match" not in out  # no meaning for a character LM (still logged)
    done = next(x for x in lines if x.startswith("finished: "))
    assert done.startswith("finished: step 4 of 4; train loss ")
    assert ", eval loss " in done and " tokens/s; " in done and done.endswith(" s wall")
    files = lines[-1]
    assert files.startswith(f"files: checkpoints {tmp_path / 'checkpoints'} (step 4)")
    assert f"samples {tmp_path / 'samples.jsonl'}" in files and f"attnlab plot {tmp_path}" in files
    assert not (tmp_path / "lock").exists()

    run = runs.load_run(tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert isinstance(run, runs.Run) and run.workdir == tmp_path
    assert run.step == 4 and run.metrics == rows
    assert run.config.to_dict() == runs.saved_config(tmp_path).to_dict()
    assert run.checkpoints() == sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    chars = json.loads((tmp_path / "tokenizer.json").read_text())["chars"]
    assert run.tokenizer.vocab_size == len(chars) and run.tokenizer.decode([1]) == chars[1]
    assert run.evaluate()["eval_loss"] == pytest.approx(rows[-1]["eval_loss"], rel=1e-6)
    text = run.generate("def ", max_new_tokens=5)
    assert isinstance(text, str) and len(text) <= 5
    assert run.model.cfg == run.trainer.mcfg
