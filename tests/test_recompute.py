"""Generation by full recomputation, for causal models and the causal-mask ablation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_count import compiles
from flax import nnx
from tiers import cases

from attnlab import GenerationResult, ModelConfig, build_model, generate
from attnlab.decode.recompute import recompute_loop

CFG = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, max_len=24, init_std=0.2)


def prefix_loop(model, prompt, n):
    """Independent reference: re-run the model on the unpadded growing prefix, take argmax."""
    seq = np.asarray(prompt)
    for _ in range(n):
        logits = np.asarray(model(jnp.asarray(seq)).logits[:, -1])
        seq = np.concatenate([seq, logits.argmax(-1)[:, None].astype(seq.dtype)], axis=1)
    return seq[:, prompt.shape[1] :]


@pytest.mark.parametrize(
    "causal",
    cases(
        [True, False],
        slow={
            True: "compiles the prefix loop and cached decoding too",
            False: "compiles the prefix loop of an encoder-decoder; the other recompute tests "
            "cover the path",
        },
    ),
)
def test_greedy_recompute_equals_the_prefix_loop(causal):
    model = build_model(ModelConfig(**CFG, causal=causal), seed=1)
    prompt = jax.random.randint(jax.random.key(0), (2, 5), 0, 40)
    out = generate(model, prompt, 8, recompute=True)
    assert isinstance(out, GenerationResult)
    np.testing.assert_array_equal(out.tokens, prefix_loop(model, prompt, 8))
    if causal:  # and the cached decoder agrees with it
        np.testing.assert_array_equal(out.tokens, generate(model, prompt, 8).tokens)
    else:  # a non-causal decoder recomputes without being asked
        np.testing.assert_array_equal(generate(model, prompt, 8).tokens, out.tokens)


@pytest.mark.slow(reason="compiles recomputation for each ragged row alone")
def test_recompute_ragged_rows_equal_each_row_alone():
    model = build_model(ModelConfig(**CFG, causal=False), seed=2)
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    batch = generate(model, prompts, 6, recompute=True, return_logits=True)
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(batch.tokens[b], prefix_loop(model, np.array([p]), 6)[0])
        np.testing.assert_array_equal(batch.tokens[b], np.argmax(batch.logits[b], -1))


@pytest.mark.slow(reason="compiles encoder-decoder generation with and without recomputation")
def test_seq2seq_recompute_equals_the_cached_decoder():
    model = build_model(ModelConfig(**CFG, arch="encoder_decoder"), seed=3)
    sources = [[3, 4, 5, 6], [7, 8]]
    cached = generate(model, sources, 6, start_id=1, return_logits=True)
    full = generate(model, sources, 6, start_id=1, return_logits=True, recompute=True)
    np.testing.assert_array_equal(full.tokens, cached.tokens)
    np.testing.assert_allclose(full.logits, cached.logits, atol=1e-5, rtol=0)


def test_recompute_rejects_overflow_and_bad_ids():
    model = build_model(ModelConfig(**CFG))
    with pytest.raises(ValueError, match="max_len=24"):
        generate(model, np.zeros((1, 20), np.int32), 8, recompute=True)
    with pytest.raises(ValueError, match=r"prompt_ids: id 99 at index \(0, 0\)"):
        generate(model, np.full((1, 3), 99, np.int32), 2, recompute=True)


def test_sampling_is_seeded():
    model = build_model(ModelConfig(**CFG, causal=False))
    prompt = np.ones((1, 3), np.int32)
    a = generate(model, prompt, 10, temperature=2.0, seed=3).tokens
    b = generate(model, prompt, 10, temperature=2.0, seed=3).tokens
    c = generate(model, prompt, 10, temperature=2.0, seed=4).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_recompute_compiles_once_per_shape_for_every_model_of_a_graph():
    """One module-level jit, the graph static and the parameters traced."""
    cfg = ModelConfig(**CFG, causal=False, n_kv_heads=2)  # a graph no other test compiles
    one, two = build_model(cfg, seed=4), build_model(cfg, seed=5)
    assert nnx.graphdef(one) == nnx.graphdef(two)
    prompt = np.full((2, 4), 3, np.int32)
    with compiles() as count:
        generate(one, prompt, 5, temperature=0.7, seed=0)
    assert count() >= 1
    size = recompute_loop._cache_size()
    with compiles() as count:
        a = generate(one, prompt, 6, temperature=0.9, top_k=4, seed=1)  # same [2, 16] buffer
        b = generate(two, prompt, 6, temperature=0.9, top_k=4, seed=1)
        generate(two, prompt, 3, eos_id=2)
    assert count() == 0 and recompute_loop._cache_size() == size
    assert not np.array_equal(a.tokens, b.tokens)  # the other model's weights were used
