"""Ring-buffer KV caches and chunked prefill: the same logits as a linear cache, less memory.

A ring of W slots serves a model whose every layer slides with window W; it must decode
past W tokens exactly as the linear cache does (and as one full forward pass, whose mask
holds the same window). Chunked prefill must give one-shot prefill's logits, for chunks
shorter and longer than the window and chunks that do not divide the prompt.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiers import cases

from attnlab import ModelConfig, build_model, init_cache, kv_cache_bytes
from attnlab import kv_cache as kvc
from attnlab.decode import Decoder, SamplingConfig, generate
from attnlab.decode.compiled import PREFILL_CHUNK, chunk_size
from attnlab.errors import DecodeError

W = 8
TINY = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_len=64)
RING = dict(TINY, init_std=0.3, sliding_window=W)
PROMPTS = [list(np.arange(19) % 47 + 2), [5, 6, 7, 8, 9], list(np.arange(12) % 13 + 30)]
N_NEW = 40  # well past the window: the ring wraps several times


@pytest.fixture(
    scope="module",
    params=cases(["rope", "alibi"], slow=dict(alibi="every ring test compiled again for ALiBi")),
)
def model(request):
    return build_model(ModelConfig(**RING, position=request.param), seed=0)


def _padded(rows, width=32):
    ids = np.zeros((len(rows), width), np.int32)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
    return jnp.asarray(ids), jnp.asarray([len(r) for r in rows], jnp.int32)


def full_logits(model, rows):
    """``[B, 64, V]`` logits of one full forward pass over right-padded ``rows``."""
    graphdef, params = nnx.split(model)
    run = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x).logits)
    return np.asarray(run(params, _padded(rows, width=64)[0]))


def decode(model, ring, chunk=None, n=N_NEW):
    """Prefill + greedy sample loop through ``Decoder``: ``(prefill logits [B, V], logits
    of every new token [B, n, V], tokens [B, n], final cache)``."""
    decoder, params = Decoder.for_model(model)
    ids, lengths = _padded(PROMPTS)
    cache = init_cache(model.cfg, len(PROMPTS), model.cfg.max_len, ring=ring)
    assert cache.slots == (W if ring else model.cfg.max_len)
    first_BV, cache = decoder.prefill(params, cache, ids, lengths, chunk=chunk)
    out = decoder.sample_loop(
        params, cache, first_BV, jax.random.key(0), np.int32(n), np.int32(-1), np.int32(0),
        SamplingConfig().traced(), return_logits=True,
    )  # fmt: skip
    logits = np.asarray(out["logits_BSV"])[:, :n]
    return np.asarray(first_BV), logits, np.asarray(out["tokens_BS"])[:, :n], out["cache"]


def test_ring_decoding_equals_the_linear_cache_and_the_full_forward(model):
    """GQA with RoPE or ALiBi, ragged prompts (19, 5, 12 tokens), 40 new tokens, W = 8."""
    _, ring_logits, ring_tokens, ring_cache = decode(model, ring=True)
    _, lin_logits, lin_tokens, lin_cache = decode(model, ring=False)
    assert ring_cache.ring and ring_cache.k.shape == (2, 3, 2, W, 8)  # [L, B, K, W, H]
    assert not lin_cache.ring and lin_cache.k.shape[3] == 64
    np.testing.assert_array_equal(ring_cache.lengths, lin_cache.lengths)
    np.testing.assert_allclose(ring_logits, lin_logits, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(ring_tokens, lin_tokens)

    # One full forward pass over what was generated (its mask holds the same window).
    full = full_logits(model, [np.r_[p, ring_tokens[b]] for b, p in enumerate(PROMPTS)])
    for b, p in enumerate(PROMPTS):
        at = len(p) - 1 + np.arange(N_NEW)
        np.testing.assert_allclose(ring_logits[b], full[b, at], atol=1e-5, rtol=0)


@pytest.mark.parametrize("ring", [False, True], ids=["linear", "ring"])
@pytest.mark.parametrize("chunk", [3, 11], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_equals_one_shot(ring, chunk):
    """Chunks of 3 (< W) and 11 (> W) tokens, neither dividing the prompts or their width."""
    model = build_model(ModelConfig(**RING, position="rope"), seed=0)
    first, logits, tokens, cache = decode(model, ring, chunk=None, n=12)
    c_first, c_logits, c_tokens, c_cache = decode(model, ring, chunk=chunk, n=12)
    np.testing.assert_allclose(c_first, first, atol=1e-5, rtol=0)
    np.testing.assert_allclose(c_logits, logits, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(c_tokens, tokens)
    np.testing.assert_array_equal(c_cache.lengths, cache.lengths)


@pytest.mark.slow(reason="generates far past the window: one compile per cache phase and chunking")
def test_generate_past_the_window_with_a_ring_and_chunks():
    """``generate`` picks the ring by default; beams reorder a ring's rows (``take_rows``)
    and score each hypothesis with its log-probability under the full forward pass."""
    model = build_model(ModelConfig(**RING, position="rope"), seed=0)
    out = generate(model, PROMPTS, N_NEW, prefill_chunk=5, return_logits=True)
    _, logits, tokens, _ = decode(model, ring=True)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_allclose(out.logits, logits, atol=1e-5, rtol=0)
    assert out.stop_reason == ["max_new_tokens"] * 3

    n = 12
    beams = generate(model, PROMPTS, n, num_beams=3, length_penalty=0.0)
    seqs = [np.r_[p, beams.tokens[b]] for b, p in enumerate(PROMPTS)]
    logp = np.asarray(jax.nn.log_softmax(full_logits(model, seqs), axis=-1))
    for b, p in enumerate(PROMPTS):
        at = len(p) - 1 + np.arange(n)
        np.testing.assert_allclose(beams.scores[b], logp[b, at, beams.tokens[b]].sum(), atol=1e-4)


@pytest.mark.slow(reason="compiles long prefills only to measure their temporaries")
def test_chunked_prefill_needs_far_less_temporary_memory():
    """Compiled only: a 4096-token prompt in chunks of 256 against one pass, linear and ring
    caches; with dense attention the one-shot program holds [B, N, T, T] scores, the chunked
    [B, N, C, S]. (The default "auto" attention is blockwise on CPU at this length, which
    keeps even one pass small: the dense implementation is named here.)"""
    cfg = ModelConfig(
        vocab_size=64,
        d_model=16,
        n_layers=1,
        n_heads=2,
        max_len=4096,
        position="rope",
        attention_impl="xla",
    )
    T, C = 4096, 256
    temps = {}
    for name, c in [("linear", cfg), ("ring", cfg.replace(sliding_window=128))]:
        decoder, params = Decoder.for_model(nnx.eval_shape(lambda c=c: build_model(c, seed=0)))
        cache = jax.eval_shape(lambda c=c: init_cache(c, 1, T))
        assert cache.ring == (name == "ring")
        args = (params, cache, jax.ShapeDtypeStruct((1, T), jnp.int32),
                jax.ShapeDtypeStruct((1,), jnp.int32))  # fmt: skip
        for chunk in (T, C):  # one pass (the default would chunk by PREFILL_CHUNK), chunks
            compiled = decoder.prefill.lower(*args, chunk=chunk).compile()
            temps[name, chunk] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["linear", T] > 10 * temps["linear", C], temps
    assert temps["ring", T] > 10 * temps["ring", C], temps
    assert temps["ring", C] < temps["linear", C] / 5, temps


def test_chunk_size_default():
    assert chunk_size(100, None) == 100 and chunk_size(4 * PREFILL_CHUNK, None) == PREFILL_CHUNK
    assert chunk_size(100, 7) == 7 and chunk_size(5, 7) == 5
    with pytest.raises(DecodeError, match="prefill_chunk=0 must be an int >= 1"):
        chunk_size(10, 0)


# ------------------------------------------------------------------------------------------
# Where a ring cannot work: errors that name the field and the fix
# ------------------------------------------------------------------------------------------


def test_ring_errors():
    mixed = ModelConfig(**TINY, sliding_window=4, sliding_window_layers=(1,))
    with pytest.raises(DecodeError, match=r"ring=True.*windows are \(None, 4\).*ring=False"):
        init_cache(mixed, 1, 32, ring=True)
    assert not init_cache(mixed, 1, 32).ring  # global layers need every key: linear
    with pytest.raises(DecodeError, match=r"ring=True .*windows are \(None, None\)"):
        kv_cache_bytes(ModelConfig(**TINY), 1, 32, ring=True)

    ring = init_cache(ModelConfig(**TINY, sliding_window=4), 1, 32)
    for cut in (lambda c: kvc.truncate(c, 2), lambda c: kvc.paste(c, c)):
        with pytest.raises(ValueError, match=r"ring buffer \(KVCache.window=4\).*ring=False"):
            cut(ring)

    # A ring cache handed to a model it cannot serve (some layers attend to every key).
    model = build_model(mixed, seed=0)
    with pytest.raises(ValueError, match=r"windows are \(None, 4\).*init_cache\(\.\.\., ring"):
        model(jnp.ones((1, 3), jnp.int32), cache=ring)

    lm = build_model(ModelConfig(**RING), seed=0)
    with pytest.raises(DecodeError, match="ring=True .* recompute=True"):
        generate(lm, [[1, 2]], 2, ring=True, recompute=True)
    with pytest.raises(DecodeError, match="prefill_chunk=-1"):
        generate(lm, [[1, 2]], 2, prefill_chunk=-1)
