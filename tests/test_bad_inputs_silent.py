"""Inputs that used to give a wrong number without a word, a traceback or a vague line: each
is now one line naming the value and the fix (and a refused command leaves its work
directory as it was). One test per case: a target id past the vocabulary, a cache written
past its capacity under ``nnx.jit``, positions past a learned table under ``jit``, sampled ids
without text, Ctrl-C while the package loads, a config file that does not parse, a refused
resume's TensorBoard files, a checkpoint's eos id past the vocabulary, and a resume with
another ``train.steps``."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_bad_inputs_startup import TINY, TRAIN, one_line, snapshot

from attnlab import ModelConfig, build_model, experiment, init_cache
from attnlab.cli import main
from attnlab.decode.checks import checked_jit
from attnlab.errors import DecodeError, TokenIdError

REPO = pathlib.Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=16)


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)


def _tiny_cfg(*overrides):
    return experiment.load_config(TINY, list(overrides))


# 1 -------------------------------------------------------------------------------------
def test_a_target_id_past_the_vocabulary_is_refused_not_a_nan_loss():
    from attnlab.train import Trainer, loss_sums

    cfg = _tiny_cfg()
    trainer = Trainer(cfg)
    B, T, V = 4, 32, trainer.mcfg.vocab_size
    targets = np.zeros((B, T), np.int32)
    targets[1, 3] = V
    batch = dict(inputs=np.zeros((B, T), np.int32), targets=targets, loss_mask=np.ones((B, T)))
    words = r"batch\['targets'\]: id 256 at index \(1, 3\) is outside \[0, model.vocab_size=256\)"
    with pytest.raises(TokenIdError, match=words + r" .*NaN.*raise model.vocab_size"):
        trainer.train_step(None, batch)  # refused before the state is read
    with pytest.raises(TokenIdError, match=words):
        trainer.evaluate(None, [batch])
    model = build_model(ModelConfig(**{**SMALL, "vocab_size": V}), seed=0)
    with pytest.raises(TokenIdError, match=words):
        loss_sums(model, batch, "lm")


# 2 -------------------------------------------------------------------------------------
def test_a_cache_written_past_its_capacity_in_an_nnx_jit_loop_raises_one_line():
    model = build_model(ModelConfig(**SMALL), seed=0)

    def body(model, ids, cache):
        out = model(ids, cache=cache)
        return out.logits, out.cache

    step = checked_jit(body, jit=nnx.jit)
    cache = init_cache(model.cfg, 1, 8)
    for _ in range(8):  # exactly full is fine
        _, cache = step(model, jnp.asarray([[3]]), cache)
    with pytest.raises(DecodeError) as e:
        step(model, jnp.asarray([[3]]), cache)
    assert str(e.value) == (
        "the cache holds 8 tokens per row but a row asks for 9 (under jit: the writes past the "
        "end are dropped and its logits are wrong): pass a larger max_len to init_cache, or "
        "use a ring cache (init_cache(..., ring=True)) for a sliding-window model"
    )
    # the plain nnx.jit loop raises the eager line when it runs (tests/test_cache_overflow.py);
    # over a cache built to flag instead: no error, the returned cache flags the row, and its
    # program holds no check at all (the jitted call keeps its fast dispatch)
    plain = nnx.jit(body)
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=r"row 0 asks for 9 "):
        plain(model, jnp.asarray([[3]]), cache)
    cache = cache.replace(on_overflow="flag")
    _, over = plain(model, jnp.asarray([[3]]), cache)
    assert np.asarray(over.overflow).tolist() == [True]
    jaxpr = jax.make_jaxpr(lambda ids, cache: body(model, ids, cache))(jnp.asarray([[3]]), cache)
    assert "check" not in str(jaxpr) and "callback" not in str(jaxpr) and not jaxpr.effects


# 3 -------------------------------------------------------------------------------------
def test_learned_positions_past_max_len_under_jit_raise_instead_of_nan():
    model = build_model(ModelConfig(**{**SMALL, "max_len": 8}, position="learned"), seed=0)
    forward = nnx.jit(lambda model, ids: model(ids).logits)
    with pytest.raises(DecodeError, match=r"^position 8 \(row 0, token 8\) .*max_len=8 "):
        forward(model, jnp.zeros((1, 12), jnp.int32))  # T is static: refused while tracing
    at = checked_jit(lambda model, ids, p: model(ids, positions_BT=p).logits, jit=nnx.jit)
    assert at(model, jnp.zeros((1, 2), jnp.int32), jnp.asarray([[6, 7]])).shape == (1, 2, 32)
    with pytest.raises(DecodeError) as e:
        at(model, jnp.zeros((1, 2), jnp.int32), jnp.asarray([[7, 8]]))
    assert str(e.value) == (
        "positions 7 to 8 reach outside the table of ModelConfig.max_len=8 positions "
        "(position='learned'): feed at most max_len tokens per row, or build a model with a "
        "larger max_len"
    )


# 4 -------------------------------------------------------------------------------------
def test_run_generate_refuses_sampled_ids_without_text_unless_asked_to_drop(monkeypatch):
    from attnlab.data.tokenizers import CharTokenizer
    from attnlab.runs.loading import Run

    tokenizer = CharTokenizer("abcde")
    task = types.SimpleNamespace(
        vocab_size=5, tokenizer=tokenizer, encode=lambda t: np.asarray(tokenizer.encode(t)),
        decode=lambda ids: tokenizer.decode(ids),
    )  # fmt: skip
    mcfg = ModelConfig(**{**SMALL, "vocab_size": 8})
    cfg = types.SimpleNamespace(eval=types.SimpleNamespace(sample_prompt="ab"))
    run = Run(None, cfg, 0, None, None, tokenizer, [], types.SimpleNamespace(mcfg=mcfg), task)
    sampled = np.asarray([0, 6, 1, 7, 2])  # 6 and 7: ids the model has, the tokenizer not
    monkeypatch.setattr("attnlab.runs.sampling.continuation", lambda *a, **k: sampled)
    with pytest.raises(DecodeError) as e:
        run.generate("ab", 5)
    assert str(e.value) == (
        "Run.generate: 2 of the 5 sampled ids have no text: the tokenizer knows ids 0-4, the "
        "model samples from model.vocab_size=8; pass on_unknown='drop' to leave them out, "
        "train longer, or set model.vocab_size to 5"
    )
    assert run.generate("ab", 5, on_unknown="drop") == "abc"


# 5 -------------------------------------------------------------------------------------
@pytest.mark.slow(reason="starts the command in a new interpreter (~5-12 s on 2 cores)")
def test_ctrl_c_while_the_package_loads_is_one_line_and_130(tmp_path):
    """The console script's first import is ``attnlab``: SIGINT from there on is held and
    reported by ``main`` (before this, Python itself is still starting)."""
    script = tmp_path / "attnlab"  # the console script's name: the package holds SIGINT
    script.write_text(
        "import os, signal, sys\nimport attnlab\nos.kill(os.getpid(), signal.SIGINT)\n"
        "from attnlab.cli import main\nsys.exit(main())\n"
    )
    new = tmp_path / "new"
    argv = [a.format(new=new) for a in TRAIN]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ATTNLAB_DEBUG", None)
    done = subprocess.run(
        [sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=120
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 128 + int(signal.SIGINT), done.stderr
    assert lines == [
        "attnlab: stopped: SIGINT arrived while the command was starting; nothing was done"
    ], done.stderr
    assert not new.exists()


def test_importing_attnlab_leaves_sigint_alone():
    import attnlab

    assert attnlab._EARLY_SIGINT is None  # not the command: nothing held
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# 6 -------------------------------------------------------------------------------------
def test_a_config_file_with_a_syntax_error_is_one_line_naming_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(variant=None)\n    return None\n")
    argv = ["train", "--config", str(bad), "--workdir", str(tmp_path / "new"), "--no-progress"]
    line = one_line(capsys, argv, 2, [], tmp_path)
    assert line == (
        f"attnlab train: error: {bad}, line 1: SyntaxError: expected ':'; fix the file and run "
        "the command again"
    )
    bad.write_text("x = (\n")  # the same through --import
    argv = ["train", "--config", TINY, "--import", str(bad), *argv[3:]]
    one_line(capsys, argv, 2, [f"{bad}, line 1: SyntaxError: '(' was never closed"], tmp_path)
    assert not (tmp_path / "new").exists()


# 7 -------------------------------------------------------------------------------------
def test_a_tracker_that_records_nothing_writes_no_file(tmp_path):
    from attnlab.runs.tracking import Tracker

    for start in (0, 3):  # a new run and a resumed one
        Tracker(_tiny_cfg(), tmp_path, start_step=start).close()
    assert list(tmp_path.iterdir()) == []
    tracker = Tracker(_tiny_cfg(), tmp_path)
    tracker.metrics({"step": 1, "train_loss": 2.5})
    tracker.close()
    assert sorted(p.name for p in (tmp_path / "tb").iterdir())[0].startswith("events.out")


@pytest.mark.slow(reason="resumes the shared tiny run twice (~6 s)")
def test_a_refused_resume_and_a_finished_one_leave_the_directory_as_it_was(
    tiny_lm_run, tmp_path, capsys, monkeypatch
):
    import shutil

    from attnlab.errors import CheckpointError

    run = shutil.copytree(tiny_lm_run, tmp_path / "run")
    (run / "lock").unlink(missing_ok=True)
    overrides = ["--config.checkpoint.every_steps=1", "--config.checkpoint.max_to_keep=3"]
    overrides += ["--config.eval.sample_tokens=4"]
    argv = [*TRAIN[:-1], str(run), *overrides]
    before = snapshot(run)
    assert main(argv) == 0  # already finished: nothing trained, nothing written
    assert "already finished" in capsys.readouterr().out
    assert snapshot(run) == before

    def unreadable(self, trainer, abstract):
        raise CheckpointError("checkpoint 3 cannot be read")

    monkeypatch.setattr("attnlab.runs.workdir.Run.initial_state", unreadable)
    one_line(capsys, argv, 1, ["checkpoint 3 cannot be read"], tmp_path, began=True)


# 8 -------------------------------------------------------------------------------------
def test_a_checkpoints_eos_id_past_the_vocabulary_names_the_file_and_the_fix():
    import attnlab

    model = build_model(ModelConfig(**{**SMALL, "vocab_size": 96}), seed=0)
    graphdef, params = nnx.split(model)
    handle = types.SimpleNamespace(
        decoding_parts=lambda: (graphdef, params, model.cfg, {"eos_id": 50256, "start_id": None}),
        path="/ckpt/gpt2", generation_config={"eos_token_id": 50256},
    )  # fmt: skip
    with pytest.raises(DecodeError) as e:
        attnlab.generate(handle, [[1, 2]], 3)
    assert str(e.value) == (
        "eos_token_id=50256 in /ckpt/gpt2/generation_config.json is outside the model's "
        "vocabulary [0, vocab_size=96): set eos_token_id there to an id below 96, or pass "
        "eos_id=None (never stop early) or an id below 96 to generate"
    )
    handle.generation_config = {}  # read from config.json
    with pytest.raises(DecodeError, match=r"in /ckpt/gpt2/config.json is outside"):
        attnlab.generate(handle, [[1, 2]], 3)
    assert attnlab.generate(handle, [[1, 2]], 3, eos_id=None).tokens.shape == (1, 3)


# 9 -------------------------------------------------------------------------------------
def _saved_run(workdir: pathlib.Path, steps: int, at: int, *overrides):
    """A work directory with a saved config and a finished checkpoint folder at ``at``."""
    cfg = _tiny_cfg(f"--config.train.steps={steps}", *overrides)
    workdir.mkdir()
    (workdir / "config.json").write_text(experiment.to_json(cfg))
    (workdir / "checkpoints" / str(at)).mkdir(parents=True)
    (workdir / "checkpoints" / str(at) / "commit_success.txt").write_text("")
    return cfg


def test_extend_keeps_the_schedules_shape_and_a_changed_total_says_what_it_does(tmp_path):
    from attnlab.runs import extend
    from attnlab.train.optim import lr_multiplier

    o = ["--config.optim.warmup_steps=2"]
    saved = _saved_run(tmp_path / "run", 10, 4, *o)
    cfg = _tiny_cfg("--config.train.steps=20", *o)
    same, consent = extend.resolve(cfg, tmp_path / "run")
    assert same.optim.extended == () and not consent  # without --extend: a plain change
    assert extend.schedule_note(saved, same, 4) == (
        "train.steps 10 -> 20: the learning-rate schedule is rebuilt for 20 steps, so at the "
        "resumed step 4 the learning rate goes from 0.00174 to 0.00195; pass --extend instead "
        "to carry on with the original schedule's shape"
    )
    longer, consent = extend.resolve(cfg, tmp_path / "run", extend=True)
    assert consent and [list(p) for p in longer.optim.extended] == [[4, 10]]
    assert extend.schedule_note(saved, longer, 4) == (
        "train.steps 10 -> 20 with --extend: the learning-rate schedule carries on from step 4 "
        "at 0.00174, its remaining shape stretched to end at step 20"
    )
    old, new = lr_multiplier(saved.optim, 10), lr_multiplier(longer.optim, 20)
    steps = np.arange(21)
    np.testing.assert_allclose(new(steps[:5]), old(steps[:5]))  # unchanged up to the resume
    k = np.arange(7)  # what was left (steps 4-10) stretched over steps 4-20
    np.testing.assert_allclose(new(4 + k * 16 / 6), old(4 + k), rtol=1e-5)
    assert np.all(np.diff(np.asarray(new(steps[4:]))) <= 0)  # decays on, no jump
    # resumed again later without --extend: the saved extension is kept
    (tmp_path / "run" / "config.json").write_text(experiment.to_json(longer))
    kept, _ = extend.resolve(_tiny_cfg("--config.train.steps=20", *o), tmp_path / "run")
    assert [list(p) for p in kept.optim.extended] == [[4, 10]]


def test_a_resume_with_another_train_steps_is_refused_naming_extend(tmp_path, capsys):
    _saved_run(tmp_path / "run", 3, 3)
    argv = [*TRAIN[:-1], str(tmp_path / "run"), "--config.train.steps=6"]
    line = one_line(capsys, argv, 2, ["train.steps: 3 -> 6", "--allow-changes"], tmp_path)
    assert "--extend to train on to the new train.steps with the schedule's shape kept" in line
    argv = [*TRAIN[:-1], str(tmp_path / "new"), "--extend"]
    line = one_line(capsys, argv, 2, [], tmp_path)
    assert line.endswith("holds no checkpoint of a run to train on; drop --extend to start the run")


@pytest.mark.slow(reason="trains the tiny run on by three steps, twice (~15 s)")
def test_extend_on_the_command_line_carries_the_rate_on(tiny_lm_run, tmp_path, capsys):
    import shutil

    overrides = ["--config.checkpoint.every_steps=1", "--config.checkpoint.max_to_keep=3"]
    overrides += ["--config.eval.sample_tokens=4", "--config.train.steps=6"]
    rates = {}
    for how in ("--allow-changes", "--extend"):
        run = shutil.copytree(tiny_lm_run, tmp_path / how.strip("-"))
        (run / "lock").unlink(missing_ok=True)
        capsys.readouterr()
        assert main([*TRAIN[:-1], str(run), *overrides, how]) == 0
        out = capsys.readouterr().out
        assert "train.steps 3 -> 6" in out, out
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rates[how] = [r["learning_rate"] for r in rows if r["step"] > 3]
    # the tiny run ends inside its 50 warmup steps: rebuilt, the warmup goes on; extended,
    # the finished schedule's last rate holds
    assert rates["--allow-changes"] == sorted(rates["--allow-changes"])
    assert len(set(rates["--allow-changes"])) == 3 and len(set(rates["--extend"])) == 1
