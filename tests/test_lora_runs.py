"""LoRA in any run (``lora.rank``, ``attnlab.train.lora``): only the adapters train and hold
optimiser state while the parameters stay bitwise; targets that match nothing fail in one
line before the work directory is touched; under muP each factor takes its own rate and the
loss falls; a stopped run resumes bitwise from checkpoints that hold no parameters, and
reopens merged (the run on 8 CPU devices: ``tests/test_lora.py``)."""

import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from attnlab import experiment, runs
from attnlab.data import make_task
from attnlab.errors import ConfigError
from attnlab.runs import surgery_run
from attnlab.runs.checkpoint import Checkpointer
from attnlab.runs.files import LORA_ADAPTERS, LORA_BASE, restore_base
from attnlab.train import Trainer, lora

REPO = pathlib.Path(__file__).resolve().parents[1]
LORA = ["--config.lora.rank=3", "--config.lora.alpha=6.0"]
FAST = ["--config.optim.learning_rate=0.03", "--config.optim.warmup_steps=1"]


def tiny(*overrides, targets='("q","v","ffn")'):
    """char_lm's tiny twin with rank-3 adapters on ``targets`` (a tuple flag given twice
    would be extended, not replaced)."""
    path = REPO / "experiments" / "char_lm.py"
    adapters = [*LORA, f"--config.lora.targets={targets}"]
    return experiment.load_config(f"{path}:tiny", [*adapters, *FAST, *overrides])


def steps(trainer, cfg, n, *, same_batch=False):
    """``n`` train steps from the initial state: ``(state before, state after, losses)``."""
    task = make_task(cfg.data, None)
    state = trainer.init_state()
    before = jax.tree.map(np.array, state)
    losses = []
    for i in range(n):
        batch = task.train_batch(0, 0 if same_batch else i, int(cfg.train.batch_size))
        state, m = trainer.train_step(state, batch)
        losses.append(float(m["loss"]))
    return before, state, losses


def test_only_the_adapters_train_and_hold_optimiser_state():
    cfg = tiny("--config.lora.dropout=0.25")  # rank dropout: drawn from each step's key
    trainer = Trainer(cfg)
    before, state, _ = steps(trainer, cfg, 3)
    for a, b in zip(
        jax.tree.leaves(before["params"]), jax.tree.leaves(state["params"]), strict=True
    ):
        np.testing.assert_array_equal(a, np.asarray(b))  # the parameters: bitwise the same
    assert sorted(state["lora"]) == [
        "decoder.layers.attn.q_DNH", "decoder.layers.attn.v_DKH", "decoder.layers.ffn.w_gate_DF",
        "decoder.layers.ffn.w_in_DF", "decoder.layers.ffn.w_out_FD",
    ]  # fmt: skip
    assert all(np.any(np.asarray(ad["b"]) != 0) for ad in state["lora"].values())
    n_opt = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim)
    assert n_opt == 2 * lora.count(state["lora"])  # Adam's two moments of the adapters alone
    # The model the evaluation reads: the adapted weights moved, the others are the base.
    weights = nnx.to_pure_dict(trainer.weights(state))["decoder"]["layers"]["attn"]
    base = nnx.to_pure_dict(before["params"])["decoder"]["layers"]["attn"]
    np.testing.assert_array_equal(np.asarray(weights["k_DKH"]), base["k_DKH"])
    assert not np.array_equal(np.asarray(weights["q_DNH"]), base["q_DNH"])


def test_targets_that_match_nothing_fail_in_one_line_before_the_run_starts(tmp_path):
    cfg = tiny(targets='("q","mlp")')
    with pytest.raises(ConfigError) as e:
        runs.train(cfg, tmp_path / "new", progress=False)
    message = str(e.value)
    assert message.startswith("lora.targets=('q', 'mlp') is invalid: 'mlp' matches no weight")
    assert "decoder.layers.attn.q_DNH" in message and "decoder.layers.ffn.w_out_FD" in message
    assert "\n" not in message
    assert not (tmp_path / "new").exists()
    # groups LoRA cannot go with, named with their fix
    for override, field in [
        ("freeze.mode=others", "freeze.mode"),
        ("optim.name=muon", "optim.name"),
    ]:
        with pytest.raises(ConfigError, match=rf"^{field}=.*with lora\.rank=3"):
            experiment.validate(tiny(f"--config.{override}"))


def test_under_mup_each_factor_takes_its_own_rate_and_the_loss_falls():
    cfg = tiny("--config.model.parametrization=mup", "--config.model.base_width=16",
               "--config.train.steps=6", "--config.optim.learning_rate=0.05",
               targets='("q","o","ffn")')  # fmt: skip
    trainer = Trainer(cfg)
    adapters = trainer.abstract_state()["lora"]
    rates = lora.lr_multipliers(trainer.lora, trainer.mcfg, "adam", adapters)
    # Adam: A (fan-in to r) as a read-out, base / fan-in; B (r to fan-out) as an input, 1.
    assert rates["decoder.layers.attn.q_DNH"] == {"a": 16 / 32, "b": 1.0}
    assert rates["decoder.layers.attn.o_NHD"] == {"a": 16 / 32, "b": 1.0}
    assert rates["decoder.layers.ffn.w_out_FD"] == {"a": 1.0, "b": 1.0}  # d_ff=64 is fixed
    _, state, losses = steps(trainer, cfg, 6, same_batch=True)  # one batch, learnt
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses
    assert max(losses[1:]) < losses[0]
    assert bool(trainer.all_finite(state["lora"]))


def test_adapters_start_on_another_run_named_by_surgery_run(tiny_lm_run):
    """A pretrained model to adapt is a surgery run's source (``surgery.run``, or a Hugging
    Face folder as ``surgery.pretrained``) with no mixer replaced: its parameters, frozen."""
    cfg = surgery_run.resolve(tiny(f"--config.surgery.run={tiny_lm_run}"))
    trainer = Trainer(cfg)
    state = surgery_run.initial_state(cfg, trainer)
    source = runs.load_run(tiny_lm_run).params
    for x, y in zip(jax.tree.leaves(source), jax.tree.leaves(state["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    for x, y in zip(jax.tree.leaves(source), jax.tree.leaves(trainer.weights(state)), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))  # B = 0: the source's model
    assert sorted(state["lora"]) == sorted(trainer.abstract_state()["lora"])


DETERMINISTIC = ("step", "train_loss", "learning_rate", "grad_norm", "eval_loss")


def _records(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in map(json.loads, lines)]


@pytest.mark.slow(reason="three tiny LoRA runs through the loop, checkpoints and load_run")
def test_a_stopped_lora_run_resumes_bitwise_and_reopens_merged(tmp_path):
    overrides = ["--config.train.steps=4", "--config.checkpoint.every_steps=2",
                 "--config.eval.every_steps=2", "--config.eval.sample_tokens=4",
                 "--config.lora.dropout=0.25", "--config.model.dropout=0.1"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    runs.train(tiny(*overrides), straight, progress=False)
    runs.train(tiny(*overrides), resumed, progress=False, stop_after=1)
    runs.train(tiny(*overrides), resumed, progress=False)
    assert _records(straight) == _records(resumed)
    a, b = runs.load_run(straight), runs.load_run(resumed)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The checkpoints hold the adapters, not the parameters; those are written once.
    with Checkpointer(straight / "checkpoints") as ckpt:
        assert "params" not in ckpt.stored_tree() and "lora" in ckpt.stored_tree()
    base = restore_base(straight, a.trainer.abstract_state()["params"])
    initial = a.trainer.init_state()["params"]  # the seed's, as the run began
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(initial), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (straight / LORA_BASE).is_dir()
    # Reopened, the run is its merged model: the last evaluation exactly, and the small file.
    assert a.evaluate()["eval_loss"] == _records(straight)[-1]["eval_loss"]
    spec, adapters = lora.load(straight / LORA_ADAPTERS)
    assert spec == a.trainer.lora
    merged = lora.merge(spec, base, adapters)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(a.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    assert isinstance(a.generate("def ", max_new_tokens=4, on_unknown="drop"), str)
    # What the state holds cannot change on resume.
    with pytest.raises(ConfigError, match="lora.rank"):
        runs.train(tiny(*overrides, "--config.lora.rank=2"), straight, progress=False)
