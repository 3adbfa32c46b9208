"""Generation by full recomputation, for causal models and the causal-mask ablation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlab import ModelConfig, build_model
from attnlab.decode import generate
from attnlab.recompute import generate_by_recompute

CFG = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, max_len=24, init_std=0.2)


def prefix_loop(model, prompt, n):
    """Independent reference: re-run the model on the unpadded growing prefix, take argmax."""
    seq = np.asarray(prompt)
    for _ in range(n):
        logits = np.asarray(model(jnp.asarray(seq)).logits[:, -1])
        seq = np.concatenate([seq, logits.argmax(-1)[:, None].astype(seq.dtype)], axis=1)
    return seq[:, prompt.shape[1] :]


@pytest.mark.parametrize("causal", [True, False])
def test_greedy_recompute_equals_the_prefix_loop(causal):
    model = build_model(ModelConfig(**CFG, causal=causal), seed=1)
    prompt = jax.random.randint(jax.random.key(0), (2, 5), 0, 40)
    got = generate_by_recompute(model, prompt, 8)
    np.testing.assert_array_equal(got, prefix_loop(model, prompt, 8))
    if causal:  # and the cached decoder agrees with it
        np.testing.assert_array_equal(got, np.asarray(generate(model, prompt, 8).tokens))


def test_recompute_rejects_overflow_and_bad_ids():
    model = build_model(ModelConfig(**CFG))
    with pytest.raises(ValueError, match="max_len=24"):
        generate_by_recompute(model, np.zeros((1, 20), np.int32), 8)
    with pytest.raises(ValueError, match="prompt ids"):
        generate_by_recompute(model, np.full((1, 3), 99, np.int32), 2)


def test_sampling_is_seeded():
    model = build_model(ModelConfig(**CFG, causal=False))
    prompt = np.ones((1, 3), np.int32)
    a = generate_by_recompute(model, prompt, 10, temperature=2.0, seed=3)
    b = generate_by_recompute(model, prompt, 10, temperature=2.0, seed=3)
    c = generate_by_recompute(model, prompt, 10, temperature=2.0, seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
