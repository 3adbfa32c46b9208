"""Model surgery at the run level (``attnlab.runs.surgery_run``) and freezing in the Trainer.

A surgery run starts from its source's checkpoint with 3 of every 4 layers turned into
Gated DeltaNet and every untouched parameter copied bitwise; bad settings are one-line errors
naming the field; the Trainer's ``freeze`` keeps the frozen parameters bitwise and moves the
others; ``init="matching"`` gives Gated DeltaNet attention's projections bitwise. In the slow
tier: a surgery run stopped by SIGTERM resumes to the losses and parameters of an
uninterrupted one, reloads with ``load_run`` as an ordinary run (the new block pattern in its
config, the frozen layer the source's bitwise) and decodes with its cache as its full
forward pass does; a sweep varies the surgery; a surgery run starts from a Hugging Face
checkpoint (one that ``export_model`` writes).
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import mixer_checks
import numpy as np
import pytest
from flax import nnx

from attnlab import build_model, experiment, runs, train
from attnlab.data import make_task
from attnlab.errors import ConfigError
from attnlab.nn import surgery
from attnlab.sweep import grid, plan_sweep, run_sweep
from attnlab.sweep.plan import apply_overrides

REPO = pathlib.Path(__file__).resolve().parents[1]
# 3 of every 4 layers (the attention ones: all of them) become Gated DeltaNet.
THREE_OF_FOUR = {
    "surgery.mixer": "gated_deltanet",
    "surgery.layers.kind": "mha",
    "surgery.layers.every": 4,
    "surgery.layers.positions": (0, 1, 2),
}


def tiny(**overrides):
    """A 4-layer decoder on the copy task: small enough to train in a second."""
    c = experiment.base_config()
    c.model.update(vocab_size=16, d_model=16, n_layers=4, n_heads=2, d_ff=32, max_len=16,
                   position="rope", norm="rmsnorm", init_std=0.1)  # fmt: skip
    c.data.update(kind="copy", seq_len=16, num_symbols=6)
    c.optim.update(learning_rate=1e-2, warmup_steps=0, schedule="constant")
    c.train.update(steps=2, batch_size=4, log_every_steps=1)
    c.eval.update(every_steps=2, batches=1, batch_size=4, sample_tokens=0)
    c.checkpoint.update(every_steps=2)
    c.track.tensorboard = False
    return apply_overrides(c, overrides)


def _pure(params):
    return nnx.to_pure_dict(params)["decoder"]


@pytest.fixture(scope="module")
def initial_source(tmp_path_factory):
    """A run's work directory holding its initial state as checkpoint 0 (no step taken)."""
    workdir = tmp_path_factory.mktemp("initial_source")
    (run,), (trainer,) = runs.open_runs([tiny()], [workdir])
    try:
        run.save(0, trainer.init_state())
    finally:
        run.close()
        run.tracker.close()
    return workdir


def test_a_surgery_run_starts_from_the_source_with_its_untouched_layers_bitwise(initial_source):
    cfg = runs.surgery_run.resolve(tiny(**THREE_OF_FOUR, **{"surgery.run": str(initial_source)}))
    assert [k["mixer"] for k in cfg.model.block_pattern.block] == ["gated_deltanet"] * 3 + ["mha"]
    trainer = train.Trainer(cfg)
    state = runs.surgery_run.initial_state(cfg, trainer)
    old = _pure(runs.load_run(initial_source).params)
    new = _pure(state["params"])
    blocks = new["layers"]["blocks"]
    for i in range(4):  # layer i: block position i, row 0; the source's row i
        parts = ("attn_norm", "ffn", "ffn_norm") + (("attn",) if i == 3 else ())
        for part in parts:
            pairs = zip(
                *(jax.tree.leaves(t[part]) for t in (old["layers"], blocks[i])), strict=True
            )
            for a, b in pairs:
                np.testing.assert_array_equal(np.asarray(b[0]), np.asarray(a[i]), strict=True)
    assert "in_proj_qkvz_DKH" in blocks[0]["attn"] and "q_DNH" not in blocks[0]["attn"]
    assert int(state["step"]) == 0
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state["acc"]))
    # the state restores into the trainer's abstract state: a checkpoint of it resumes
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
    assert shapes(state) == shapes(trainer.abstract_state())


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A trained 4-layer run: the surgery's source."""
    workdir = tmp_path_factory.mktemp("source")
    runs.train(tiny(), workdir, progress=False)
    return workdir


def test_the_trainer_freezes_by_selection_and_trains_the_rest(tmp_path):
    # Train the mixer of layer 1 alone: every other parameter is frozen.
    cfg = tiny(**{"freeze.mode": "others", "freeze.part": "mixer", "freeze.layers.index": (1,)})
    task = make_task(cfg.data, tmp_path)
    trainer = train.Trainer(cfg, kind=task.kind)
    state = trainer.init_state()
    flat = lambda p: jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(p))[0]
    before = [(tuple(k.key for k in path), np.asarray(a)) for path, a in flat(state["params"])]
    # The gradient the step logs is layer 1's mixer's alone (the frozen ones count for 0).
    batch0 = task.train_batch(0, 0, 4)
    _, tokens, grads, _ = jax.jit(trainer._grads)(state["params"], batch0, jax.random.key(0))
    in_layer_1_attn = lambda path: {"layers", "attn"} <= {k.key for k in path}
    trained = [np.asarray(g, np.float64)[1] for path, g in flat(grads) if in_layer_1_attn(path)]
    want = np.sqrt(sum((g**2).sum() for g in trained)) / float(tokens)
    for step in range(2):
        state, metrics = trainer.train_step(state, task.train_batch(0, step, 4))
        if step == 0:
            np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=1e-4)
    moved = []
    for (path, a), (_, b) in zip(before, flat(state["params"]), strict=True):
        b = np.asarray(b)
        keep = np.ones(a.shape[:1], bool)  # rows kept: a stacked [L, ...] leaf's layers
        if "layers" in path and "attn" in path:
            keep[1] = False
            moved.append(not np.array_equal(b[1], a[1]))
        if "layers" not in path:
            keep = np.ones(a.shape, bool) if a.ndim else np.ones((), bool)
        np.testing.assert_array_equal(b[keep], a[keep], strict=True)
    assert moved and all(moved), moved  # each of layer 1's mixer parameters trained


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"surgery.run": "/no/such/run"}, "surgery.run="),
        ({"surgery.layers.index": (4,)}, "surgery.layers.index=4"),
        ({"surgery.layers.kind": "mamba2"}, "surgery.layers.kind='mamba2'"),
        ({"surgery.layers.positions": (0,)}, "surgery.layers.every=0"),
        ({"surgery.layers.every": 4, "surgery.layers.positions": (4,)}, "positions=4"),
        ({"surgery.mixer": "no_such_mixer"}, "surgery.mixer="),
        ({"surgery.init": "copy"}, "surgery.init='copy'"),
        ({"model.d_model": 32}, "model.d_model=32"),
        ({"freeze.mode": "all"}, "freeze.mode='all'"),
        ({"freeze.mode": "selected", "freeze.layers.index": (7,)}, "freeze.layers.index=7"),
    ],
)
def test_bad_surgery_settings_are_one_line_errors_naming_the_field(
    initial_source, overrides, field
):
    cfg = tiny(**{"surgery.run": str(initial_source), "surgery.mixer": "gated_deltanet"})
    cfg = apply_overrides(cfg, overrides)
    with pytest.raises(ConfigError) as e:
        experiment.validate(runs.surgery_run.resolve(cfg))
    assert field in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_missing_source_checkpoint_names_the_step(initial_source, tmp_path):
    cfg = tiny(**THREE_OF_FOUR, **{"surgery.run": str(initial_source), "surgery.step": 7})
    with pytest.raises(ConfigError, match=r"surgery\.step=7 is invalid.*steps \[0\]") as e:
        runs.train(cfg, tmp_path, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "config.json").exists()  # refused before the run began


def test_a_begun_surgery_run_resumes_without_its_source(initial_source, tmp_path):
    shutil.copytree(initial_source, tmp_path / "source")
    cfg = tiny(**THREE_OF_FOUR, **{"surgery.run": str(tmp_path / "source")})
    resolved = runs.surgery_run.resolve(cfg)
    (tmp_path / "run").mkdir()  # a run that began: its config.json holds the surgery
    (tmp_path / "run" / "config.json").write_text(experiment.to_json(resolved))
    shutil.rmtree(tmp_path / "source")
    again = runs.surgery_run.resolve(cfg, tmp_path / "run")
    assert experiment.to_json(again) == experiment.to_json(resolved)
    with pytest.raises(ConfigError, match=r"^surgery\.run="):  # a new run needs the source
        runs.surgery_run.resolve(cfg, tmp_path / "elsewhere")


def test_the_new_mixers_settings_take_dotted_overrides(initial_source, tmp_path):
    saved = tmp_path / "surgery.json"
    saved.write_text(experiment.to_json(tiny(**{"surgery.run": str(initial_source)})))
    overrides = ["--config.surgery.mixer=gated_deltanet",
                 "--config.surgery.mixer_settings.form=recurrent"]  # fmt: skip
    cfg = runs.surgery_run.resolve(experiment.load_config(str(saved), overrides))
    (kind,) = cfg.model.block_pattern.block  # no selection: every layer
    assert (kind["mixer"], kind["mixer_settings"]["form"]) == ("gated_deltanet", "recurrent")


def _metrics(workdir):
    keep = ("step", "train_loss", "grad_norm", "eval_loss")
    rows = (json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines())
    return [{k: r[k] for k in keep if k in r} for r in rows]


@pytest.mark.slow(reason="starts the attnlab command and stops it with SIGTERM, then resumes")
def test_a_surgery_run_resumes_exactly_after_sigterm_and_reloads_as_an_ordinary_run(
    source, tmp_path, monkeypatch
):
    # 3 of 4 layers become Gated DeltaNet; the attention layer kept is frozen.
    overrides = {**THREE_OF_FOUR, "surgery.run": str(source), "train.steps": 120,
                 "train.log_every_steps": 10, "checkpoint.every_steps": 1000,
                 "eval.every_steps": 1000, "freeze.mode": "selected",
                 "freeze.layers.kind": "mha"}  # fmt: skip
    cfg = tiny(**overrides)
    runs.train(cfg, tmp_path / "straight", progress=False)
    saved = tmp_path / "surgery.json"
    saved.write_text(experiment.to_json(cfg))
    cmd = [sys.executable, "-m", "attnlab.cli", "train", "--no-progress", "--config",
           str(saved), "--workdir", str(tmp_path / "resumed")]  # fmt: skip
    # the command computes as this process does (conftest.py sets the matmul precision)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    for line in proc.stdout:
        if line.startswith("step=10 "):
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "SIGTERM" in out, out
    stopped = runs.load_run(tmp_path / "resumed").step
    assert 10 <= stopped < 120, out
    record = runs.train(cfg, tmp_path / "resumed", progress=False)  # resumes, no surgery again
    assert record["step"] == 120
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "straight")
    run, straight = (runs.load_run(tmp_path / d) for d in ("resumed", "straight"))
    for x, y in zip(jax.tree.leaves(straight.params), jax.tree.leaves(run.params), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x), strict=True)
    # An ordinary run: its config holds the new block pattern, the frozen layer is the
    # source's bitwise, and cached decoding gives the full forward pass's logits.
    saved = json.loads((tmp_path / "resumed" / "config.json").read_text())
    assert [k["mixer"] for k in saved["model"]["block_pattern"]["block"]] == [
        "gated_deltanet"
    ] * 3 + ["mha"]
    old, new = _pure(runs.load_run(source).params), _pure(run.params)
    kept = new["layers"]["blocks"][3]  # layer 3: block position 3, row 0
    for part in ("attn", "attn_norm", "ffn", "ffn_norm"):
        for a, b in zip(*(jax.tree.leaves(t[part]) for t in (old["layers"], kept)), strict=True):
            np.testing.assert_array_equal(np.asarray(b[0]), np.asarray(a[3]), strict=True)
    assert not np.array_equal(new["final_norm"]["scale_D"], old["final_norm"]["scale_D"])
    monkeypatch.setattr(mixer_checks, "build_model", lambda cfg, seed: run.model)
    mixer_checks.prefill_then_steps(run.trainer.mcfg)


@pytest.mark.slow(reason="a sweep of two surgery trials, each its own program")
def test_a_sweep_varies_the_surgery(source, tmp_path):
    spec = tmp_path / "surgery.json"
    layers = {"surgery.layers.every": 2, "surgery.layers.positions": (0,)}  # layers 0 and 2
    spec.write_text(experiment.to_json(tiny(**layers, **{"surgery.run": str(source)})))
    plan = plan_sweep(str(spec), [], grid({"surgery.mixer": ["gated_deltanet", "mamba2"]}))
    results = run_sweep(plan, tmp_path / "sweep", log=lambda *_: None)
    assert [r["status"] for r in results["trials"]] == ["finished"] * 2
    for t in plan.trials:
        run = runs.load_run(tmp_path / "sweep" / t.name)
        mixer = t.overrides["surgery.mixer"]
        assert surgery.layer_kind_names(run.trainer.mcfg) == (mixer, "mha") * 2
        assert np.isfinite(run.evaluate()["eval_loss"])


@pytest.mark.slow(
    reason="exports a Llama checkpoint and loads it back; the fast tier starts from a run"
)
def test_a_surgery_run_starts_from_a_hugging_face_checkpoint(tmp_path):
    from attnlab import ModelConfig, load_pretrained
    from attnlab.pretrained.export import export_model

    llama = ModelConfig(vocab_size=16, d_model=16, n_layers=4, n_heads=2, n_kv_heads=1,
                        d_ff=32, max_len=16, position="rope", norm="rmsnorm", norm_eps=1e-6,
                        ffn="swiglu", tie_embeddings=False)  # fmt: skip
    assert export_model(build_model(llama, seed=1), tmp_path / "hf") == "llama"
    cfg = tiny(**THREE_OF_FOUR, **{"surgery.pretrained": str(tmp_path / "hf")})
    with cfg.unlocked():
        cfg.model = experiment.base_config().model  # unset: the checkpoint decides
    cfg = runs.surgery_run.resolve(apply_overrides(cfg, {"surgery.init": "matching"}))
    trainer = train.Trainer(cfg)
    assert surgery.layer_kind_names(trainer.mcfg) == ("gated_deltanet",) * 3 + ("mha",)
    assert (trainer.mcfg.ffn, trainer.mcfg.tie_embeddings) == ("swiglu", False)
    state = runs.surgery_run.initial_state(cfg, trainer)
    old = _pure(load_pretrained(tmp_path / "hf").params)["layers"]
    new = _pure(state["params"])["layers"]["blocks"]
    for a, b in zip(jax.tree.leaves(old["ffn"]), jax.tree.leaves(new[3]["ffn"]), strict=True):
        np.testing.assert_array_equal(np.asarray(b[0]), np.asarray(a[3]), strict=True)
    qkvz = np.asarray(new[1]["attn"]["in_proj_qkvz_DKH"][0])  # layer 1, with attention's q
    np.testing.assert_array_equal(qkvz[:, :, :8], np.asarray(old["attn"]["q_DNH"][1]))


def test_matching_init_gives_gated_deltanet_the_attention_projections_bitwise():
    from attnlab import ModelConfig

    cfg = ModelConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_len=16, position="rope", norm="rmsnorm")  # fmt: skip
    params = nnx.state(build_model(cfg, seed=1))
    _, new = surgery.replace_mixer(cfg, params, [0], "gated_deltanet", init="matching", seed=3)
    _, fresh = surgery.replace_mixer(cfg, params, [0], "gated_deltanet", seed=3)
    old = {k: np.asarray(v[0]) for k, v in _pure(params)["layers"]["attn"].items()}
    mixer = lambda p: _pure(p)["layers"]["blocks"][0]["attn"]  # block: [gated_deltanet, mha]
    got = {k: np.asarray(v[0]) for k, v in mixer(new).items()}
    ref = {k: np.asarray(v[0]) for k, v in mixer(fresh).items()}
    H = 4  # head_dim; per key head the fused projection holds q, k, v (one value head), z
    qkvz = got["in_proj_qkvz_DKH"]
    np.testing.assert_array_equal(qkvz[:, :, :H], old["q_DNH"], strict=True)
    np.testing.assert_array_equal(qkvz[:, :, H : 2 * H], old["k_DKH"][:, [0, 0, 1, 1]])
    np.testing.assert_array_equal(qkvz[:, :, 2 * H : 3 * H], old["v_DKH"][:, [0, 0, 1, 1]])
    np.testing.assert_array_equal(got["out_proj_NJD"], old["o_NHD"], strict=True)
    # the gate z and everything else stay as the fresh initialisation made them
    np.testing.assert_array_equal(qkvz[:, :, 3 * H :], ref["in_proj_qkvz_DKH"][:, :, 3 * H :])
    for k in ("conv_WZ", "in_proj_ba_DKH", "A_log_N", "dt_bias_N", "norm_scale_J"):
        np.testing.assert_array_equal(got[k], ref[k], strict=True)
