"""Multi-token prediction (``model.mtp_depth``): the objective equals DeepSeek-V3's
``main + λ mean_k CE_k`` computed in float64 from the parameters, and speculative decoding
with the MTP modules returns the greedy decoding's tokens."""

import pathlib

import decoder_reference as dref
import jax
import numpy as np
import pytest
from flax import nnx

from attnlab import experiment, generate
from attnlab.decode.speculative import speculative_generate
from attnlab.errors import ConfigError, DecodeError
from attnlab.nn import build_model
from attnlab.train import Trainer

REPO = pathlib.Path(__file__).resolve().parents[1]
B, T, V = 2, 8, 16


def tiny(depth=2, *overrides, **model):
    cfg = experiment.load_config(f"{REPO / 'experiments' / 'char_lm.py'}:tiny", list(overrides))
    cfg.model.update(
        dict(vocab_size=V, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=32, ffn="gelu",
             dropout=0.0, attention_dropout=0.0, mtp_depth=depth) | model
    )  # fmt: skip
    cfg.data.seq_len = T
    cfg.train.batch_size = B
    return cfg


@pytest.mark.slow(reason="compiles a train state and the objective of an MTP model (~9 s)")
def test_objective_equals_the_float64_mtp_objective():
    rng = np.random.default_rng(0)
    batch = {
        "inputs": rng.integers(0, V, (B, T), dtype=np.int32),
        "targets": rng.integers(0, V, (B, T), dtype=np.int32),
        "loss_mask": (rng.random((B, T)) < 0.8).astype(np.float32),
    }
    trainer = Trainer(tiny(2, "--config.train.loss_weights.mtp=0.5"), kind="lm")
    params = trainer.init_state()["params"]
    objective, (s, n, readings) = jax.jit(trainer.objective)(params, batch)
    p = jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(params)))
    want, main, ces = dref.mtp_objective(
        p, batch["inputs"], batch["targets"], batch["loss_mask"], n_layers=2, depth=2,
        weight=0.5, eps=trainer.mcfg.norm_eps,
    )  # fmt: skip
    np.testing.assert_allclose(float(s / n), main, rtol=1e-5)
    sums, counts = readings["mtp"]
    np.testing.assert_allclose(np.asarray(sums / counts), ces, rtol=1e-5)
    np.testing.assert_allclose(float(objective / n), want, rtol=1e-5)


def test_mtp_needs_a_causal_decoder_and_a_depth_to_draft_with():
    with pytest.raises(ConfigError, match="mtp_depth"):
        experiment.validate(tiny(1, "--config.model.causal=False"))
    model = nnx.eval_shape(lambda: build_model(experiment.validate(tiny(0)), rngs=nnx.Rngs(0)))
    with pytest.raises(DecodeError, match="mtp_depth=0"):
        speculative_generate(model, np.zeros((1, 3), np.int32), 4)


@pytest.mark.slow(reason="compiles greedy decoding and two speculative loops (~12 s)")
def test_speculative_decoding_returns_the_greedy_tokens():
    model = build_model(experiment.validate(tiny(2)), seed=0)
    prompt = np.random.default_rng(1).integers(0, V, (2, 5))
    want = np.asarray(generate(model, prompt, 12, temperature=0.0).tokens)
    for depth in (1, 2):
        got = speculative_generate(model, prompt, 12, depth=depth)
        np.testing.assert_array_equal(got.tokens, want)
        assert 1.0 <= got.tokens_per_step <= depth + 1


@pytest.mark.slow(reason="trains a small model for 60 steps so that its drafts are accepted")
def test_drafts_of_a_trained_model_are_accepted_and_the_output_stays_greedy():
    cfg = tiny(2)
    cfg.optim.update(learning_rate=1e-2, warmup_steps=0)
    trainer = Trainer(cfg, kind="lm")
    state = trainer.init_state()
    seq = np.arange(T + 1) % 5  # a cycle: every depth can predict it
    rows = np.stack([np.roll(seq, -i) for i in range(B)])
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": np.ones((B, T), "f4")}
    for _ in range(60):
        state, out = trainer.train_step(state, batch)
    model = trainer.model(state["params"])
    prompt = rows[:, :4]
    want = np.asarray(generate(model, prompt, 16, temperature=0.0).tokens)
    got = speculative_generate(model, prompt, 16, depth=2)
    np.testing.assert_array_equal(got.tokens, want)
    assert got.tokens_per_step >= 1.5, (got.steps, got.accepted, float(out["metrics"]["mtp"][1]))
