"""Checks every attention variant (``attnlab.contracts.mixer``) must pass, shared by the variants'
tests: cached decoding (prefill of ragged prompts, then one token at a time, or a prefill in
chunks) equals one full forward pass; generation with the cache equals generation by
recomputation; gradients stay finite when whole rows are masked; bad settings are one-line
errors naming the field. And the tiny configs they run on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import ModelConfig, build_model, init_cache, kv_cache_bytes
from attnlab.contracts.mixer import get_mixer
from attnlab.decode import Decoder
from attnlab.errors import ConfigError

TINY = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=16, init_std=0.3)


def hybrid(layer, **changes) -> ModelConfig:
    """``TINY`` with its layers alternating ``layer`` (a mixer's name, or a layer's fields)
    and attention."""
    return ModelConfig(**{**TINY, "block_pattern": {"block": (layer, "mha")}, **changes})


def hybrid_cache_entries(cfg: ModelConfig, mixer: str) -> dict:
    """The cache entries of ``mixer`` (default settings) in the hybrid ``cfg``, whose cache
    grows with its length by the attention layer's keys and values alone."""
    grow = kv_cache_bytes(cfg, 1, 16, "float32") - kv_cache_bytes(cfg, 1, 8, "float32")
    assert grow == 8 * 2 * cfg.d_model * 4
    return get_mixer(mixer).cache_entries(cfg, get_mixer(mixer).Settings())


def prefill_then_steps(
    cfg: ModelConfig, *, seed: int = 2, atol: float = 1e-5, steps: int = 4, rewind: bool = False
):
    """Ragged prompts (3 and 6 tokens) are prefilled, then stepped token by token towards
    T = 10; every logit equals the full forward pass's (decoder and encoder-decoder alike).

    ``rewind``: each step sets the rows' lengths to the position it feeds, so a row that
    reached T - 1 writes its last slot again and again (the slot overwritten in place)."""
    model = build_model(cfg, seed=seed)
    decoder, params = Decoder.for_model(model)
    B, T, P = 2, 10, 8
    prompt_B = jnp.array([3, 6], jnp.int32)
    ids_BT = jax.random.randint(jax.random.key(3), (B, T), 1, cfg.vocab_size)
    src_BS = jax.random.randint(jax.random.key(4), (B, 7), 1, cfg.vocab_size)
    valid_BS = jnp.arange(7)[None, :] < jnp.array([[7], [4]])

    @jax.jit
    def run(params):
        cache = init_cache(cfg, B, cfg.max_len)
        model = nnx.merge(decoder.graphdef, params)
        if decoder.seq2seq:
            full_BTV = model(src_BS, ids_BT, src_valid_BS=valid_BS).logits
            cache = decoder.encode_fn(params, cache, src_BS, valid_BS)
        else:
            full_BTV = model(ids_BT).logits
        prompt_BP = jnp.where(jnp.arange(P)[None, :] < prompt_B[:, None], ids_BT[:, :P], 0)
        first_BV, cache = decoder.prefill_fn(params, cache, prompt_BP, prompt_B)

        def step(cache, i):
            pos_B = jnp.minimum(prompt_B + i, T - 1)  # row 0 is behind row 1
            if rewind:
                cache = cache.replace(lengths=pos_B)
            logits_BV, cache = decoder.decode_step_fn(params, cache, ids_BT[jnp.arange(B), pos_B])
            return cache, (pos_B, logits_BV)

        _, (pos_IB, steps_IBV) = jax.lax.scan(step, cache, jnp.arange(steps))
        return full_BTV, first_BV, pos_IB, steps_IBV

    full_BTV, first_BV, pos_IB, steps_IBV = (np.asarray(x) for x in run(params))
    rows = np.arange(B)
    np.testing.assert_allclose(first_BV, full_BTV[rows, np.asarray(prompt_B) - 1], atol=atol)
    for pos_B, logits_BV in zip(pos_IB, steps_IBV, strict=True):
        np.testing.assert_allclose(logits_BV, full_BTV[rows, pos_B], atol=atol, rtol=0)
    return pos_IB


def split_prefill_equals_forward(cfg, *, chunk, seed=2):
    """Ragged prompts (5 and 8 tokens) prefilled in chunks of ``chunk`` (the cache holding
    earlier chunks) give each row's last-token logits of one forward pass."""
    model = build_model(cfg, seed=seed)
    decoder, params = Decoder.for_model(model)
    lengths_B = jnp.array([5, 8], jnp.int32)
    ids_BT = jax.random.randint(jax.random.key(5), (2, 8), 1, cfg.vocab_size)

    @jax.jit
    def run(params):
        full_BTV = nnx.merge(decoder.graphdef, params)(ids_BT).logits
        cache = init_cache(cfg, 2, cfg.max_len)
        first_BV, _ = decoder.prefill_fn(params, cache, ids_BT, lengths_B, chunk=chunk)
        return full_BTV[jnp.arange(2), lengths_B - 1], first_BV

    want, got = run(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def generate_matches_recompute(cfg: ModelConfig, *, seed: int = 2, num_beams: int = 1):
    """Greedy (or beam) generation through the cache equals generation that recomputes the
    whole prefix at every token, on a ragged batch."""
    model = build_model(cfg, seed=seed)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    cached = attnlab.generate(model, prompts, 5, num_beams=num_beams, eos_id=None)
    again = attnlab.generate(model, prompts, 5, num_beams=num_beams, eos_id=None, recompute=True)
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(again.tokens))


def grads_finite_with_masked_rows(cfg: ModelConfig, *, seed: int = 2):
    """A row whose every key is padding (fully masked attention rows): finite gradients."""
    model = build_model(cfg, seed=seed)
    graphdef, params = nnx.split(model)
    ids_BT = jnp.array([[3, 4, 5, 6], [7, 8, 9, 1]])
    valid_BT = jnp.array([[True, True, True, False], [False, False, False, False]])

    def loss(params):
        out = nnx.merge(graphdef, params)(ids_BT, valid_BT=valid_BT)
        return jnp.sum(out.logits**2) * 1e-3

    grads = jax.grad(loss)(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def beam_scores_match_forward(cfg: ModelConfig, *, seed: int = 2, num_beams: int = 3):
    """Beam search reorders every cache entry with its rows (per-token and state alike):
    each returned beam's score is its sequence's log-probability under one full pass."""
    model = build_model(cfg, seed=seed)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    beams = attnlab.generate(model, prompts, 4, num_beams=num_beams, length_penalty=0.0)
    for b, prompt in enumerate(prompts):
        seq = np.r_[prompt, beams.tokens[b]]
        logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(seq[None, :-1])).logits[0], -1))
        at = len(prompt) - 1 + np.arange(len(beams.tokens[b]))
        want = float(np.sum(logp[at, beams.tokens[b]]))
        np.testing.assert_allclose(beams.scores[b], want, atol=1e-4)


def bad_settings(mixer: str, changes: dict, words):
    """``TINY`` with ``mixer`` and the settings ``changes``: a one-line ``ConfigError``
    holding each of ``words``."""
    one_line_config_error(words, **TINY, mixer=mixer, mixer_settings=changes)


def one_line_config_error(words, **fields):
    """``ModelConfig(**fields)`` raises a ``ConfigError`` of one line holding each of
    ``words`` (the field and what it takes)."""
    with pytest.raises(ConfigError) as info:
        ModelConfig(**fields)
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
