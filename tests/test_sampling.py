"""Token sampling: filters against NumPy references, greedy limits, seeded reproducibility."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_count import compiles

from attnlab import ModelConfig, build_model
from attnlab.decode import (
    Decoder,
    SamplingConfig,
    filter_logits,
    generate,
    min_p_filter,
    sample,
    top_k_filter,
    top_p_filter,
)

V = 20
LOGITS = np.asarray(jax.random.normal(jax.random.key(0), (4, V)) * 2.0, np.float32)


def _probs(logits):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _nucleus(row, p):
    """The smallest set of most probable tokens whose mass is >= p."""
    probs = _probs(row.astype(np.float64))
    order = np.argsort(-probs)
    n = int(np.searchsorted(np.cumsum(probs[order]), p) + 1)
    return set(order[:n].tolist())


def _kept(filtered_BV):
    return [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in np.asarray(filtered_BV)]


def _draws(logits_BV, sampling, n=300):
    keys = jax.random.split(jax.random.key(1), n)
    return np.asarray(
        jax.jit(jax.vmap(lambda k: sample(jnp.asarray(logits_BV), k, sampling)))(keys)
    )


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_never_leaves_the_k_best(k):
    best = [set(np.argsort(-row)[:k].tolist()) for row in LOGITS]
    assert _kept(top_k_filter(jnp.asarray(LOGITS), k)) == best
    if k == 7:  # draws (one compile): a hot temperature reaches many, never beyond the k
        draws_NB = _draws(LOGITS, SamplingConfig(temperature=3.0, top_k=k))
        for b in range(4):
            assert len(set(draws_NB[:, b].tolist())) > 1 and set(draws_NB[:, b]) <= best[b]


@pytest.mark.parametrize("p", [0.05, 0.3, 0.75, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_with_mass_p(p):
    assert _kept(top_p_filter(jnp.asarray(LOGITS), p)) == [_nucleus(r, p) for r in LOGITS]


def test_top_p_after_top_k_renormalises_within_the_k():
    k, p = 5, 0.8
    kept = _kept(filter_logits(jnp.asarray(LOGITS), SamplingConfig(1.0, top_k=k, top_p=p)))
    for b, row in enumerate(LOGITS):
        masked = np.full(V, -np.inf, np.float32)
        top = np.argsort(-row)[:k]
        masked[top] = row[top]
        assert kept[b] == _nucleus(masked, p)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top(min_p):
    probs = _probs(LOGITS.astype(np.float64))
    want = [set(np.flatnonzero(r >= min_p * r.max() * (1 - 1e-6)).tolist()) for r in probs]
    assert _kept(min_p_filter(jnp.asarray(LOGITS), min_p)) == want
    if min_p == 0.1:
        draws_NB = _draws(LOGITS, SamplingConfig(temperature=1.0, min_p=min_p), n=100)
        for b in range(4):
            assert set(draws_NB[:, b].tolist()) <= want[b]


def test_temperature_to_zero_equals_greedy():
    greedy = np.argmax(LOGITS, -1)
    np.testing.assert_array_equal(sample(jnp.asarray(LOGITS), None, SamplingConfig()), greedy)
    for key in range(5):
        cold = sample(jnp.asarray(LOGITS), jax.random.key(key), SamplingConfig(1e-4))
        np.testing.assert_array_equal(cold, greedy)


def test_sampling_follows_the_softmax():
    draws = _draws(LOGITS[:1], SamplingConfig(temperature=1.0), n=4000)[:, 0]
    freq = np.bincount(draws, minlength=V) / len(draws)
    np.testing.assert_allclose(freq, _probs(LOGITS[0]), atol=0.03)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=-0.1), "min_p"),
    ],
)
def test_invalid_sampling_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_same_seed_same_tokens_other_seed_other_tokens():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=64, init_std=0.3)
    model = build_model(cfg, seed=0)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    hot = dict(temperature=2.0, top_k=40, top_p=0.95, min_p=0.01)
    a = generate(model, prompts, 12, seed=7, **hot)
    b = generate(model, prompts, 12, seed=7, **hot)
    c = generate(model, prompts, 12, seed=8, **hot)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).mean() > 0.3
    greedy = generate(model, prompts, 12)
    assert (a.tokens != greedy.tokens).any()


def test_new_sampling_values_reuse_the_compiled_loop():
    """Temperature, top-k, top-p and min-p are traced: changing them compiles nothing."""
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=64, init_std=0.3)
    model = build_model(cfg, seed=0)
    decoder, _ = Decoder.for_model(model)
    prompts = [[5, 6, 7], [8, 9]]
    first = generate(model, prompts, 8, temperature=0.5, seed=1)
    traces = dict(decoder.traces)
    settings = [
        dict(temperature=0.9),
        dict(temperature=0.9, top_p=0.9),
        dict(temperature=0.9, top_p=0.8),
        dict(temperature=0.9, min_p=0.1),
        dict(temperature=0.9, top_k=5),
        dict(temperature=0.9, top_k=7, top_p=0.8, min_p=0.05),
        dict(),  # greedy: a traced select, still the same program
    ]
    with compiles() as count:
        outs = [generate(model, prompts, 8, seed=1, **s) for s in settings]
        again = generate(model, prompts, 8, temperature=0.5, seed=1)
    assert count() == 0 and dict(decoder.traces) == traces
    np.testing.assert_array_equal(again.tokens, first.tokens)
    assert (outs[0].tokens != outs[-1].tokens).any()  # the settings took effect
    hot = generate(model, prompts, 8, temperature=5.0, top_k=3, return_logits=True)
    rank = (hot.logits > np.take_along_axis(hot.logits, hot.tokens[..., None], -1)).sum(-1)
    assert rank.max() < 3  # a traced k still keeps every draw among the k best
    # Greedy through the traced select is exactly the argmax of the logits it returns.
    greedy = generate(model, prompts, 8, return_logits=True)
    np.testing.assert_array_equal(greedy.tokens, np.argmax(greedy.logits, -1))
    np.testing.assert_array_equal(outs[-1].tokens, greedy.tokens)


def test_greedy_argmax_is_numpys_first_maximum():
    """``sampling.argmax`` (a max and a min, faster on CPU) picks what ``np.argmax`` picks:
    the first of tied maxima, the first NaN, index 0 of an all -inf row."""
    from attnlab.decode.sampling import argmax

    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 50257)).astype(np.float32)
    x[1, [7, 9000, 40000]] = 9.0  # ties
    x[2, [5, 17]] = np.nan
    x[3] = -np.inf
    x[4, -1] = np.inf
    x[5] = np.round(x[5])  # many ties
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
