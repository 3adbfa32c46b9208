"""KV-cache decoding: cached == full forward, ragged batches, EOS, capacity, beams, compiles.

Models are tiny and share one graph where they can: ``Decoder`` is shared per graph, so
tests reuse each other's compiled programs.
"""

import math
import re

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import ModelConfig, build_model, init_cache, kv_cache_bytes
from attnlab.decode import Decoder, SamplingConfig, generate, phases

TINY = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_len=64, init_std=0.3)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def lm():
    return build_model(ModelConfig(**TINY), seed=0)


@pytest.fixture(scope="module")
def s2s():
    return build_model(ModelConfig(**TINY, arch="encoder_decoder"), seed=1)


def _full_logits(model):
    """A jitted full forward pass (no cache): [B, T, V] logits."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, *ids):
        return nnx.merge(graphdef, params)(*ids).logits

    return lambda *ids: np.asarray(run(params, *(jnp.asarray(x) for x in ids)))


# ------------------------------------------------------------------------------------------
# Cached decoding == one full forward pass, for every value of every factor
# ------------------------------------------------------------------------------------------

COMBOS = [
    dict(position="learned", n_kv_heads=4, norm_placement="pre"),  # MHA
    dict(position="sinusoidal", n_kv_heads=2, norm_placement="post"),  # GQA
    dict(position="rope", n_kv_heads=1, sliding_window=3),  # MQA
    dict(position="alibi", n_kv_heads=2, sliding_window=4, norm="rmsnorm", ffn="swiglu"),
    dict(position="relative", n_kv_heads=4, norm_placement="post", qk_norm=True),
]


# The fast tier keeps one case per architecture (ALiBi biases for the decoder, rotary
# positions for the encoder-decoder: the quickest to compile); each case compiles one program.
FAST_CASES = {("alibi", "decoder"), ("rope", "encoder_decoder")}
SLOW_CASE = pytest.mark.slow(reason="another position x architecture case: a compile-bound program")


@pytest.mark.parametrize(
    "arch,combo",
    [
        pytest.param(
            arch,
            combo,
            id=f"{combo['position']}-{arch}",
            marks=() if (combo["position"], arch) in FAST_CASES else SLOW_CASE,
        )
        for arch in ["decoder", "encoder_decoder"]
        for combo in COMBOS
    ],
)
def test_prefill_plus_steps_equals_full_forward(arch, combo):
    """Ragged prompts (3 and 6 tokens) are prefilled, then stepped token by token to T.

    The Decoder's step bodies run inside one test-jitted program (one compile per model):
    prefill, a scan of decode steps, and the full forward pass they must match.
    """
    layers = dict(n_layers=1, n_decoder_layers=2) if arch == "encoder_decoder" else {}
    cfg = ModelConfig(**{**TINY, "max_len": 16, **layers}, arch=arch, **combo)
    T = 10
    pos_IB = mixer_checks.prefill_then_steps(cfg, seed=2, steps=T - 3, rewind=True)
    assert pos_IB[-1].tolist() == [T - 1, T - 1]


# ------------------------------------------------------------------------------------------
# Generation: ragged batches, recomputation, EOS, compiles
# ------------------------------------------------------------------------------------------


def test_ragged_batch_equals_each_prompt_alone(lm):
    batch = generate(lm, PROMPTS, 6, return_logits=True)
    assert batch.tokens.shape == (3, 6) and batch.logits.shape == (3, 6, 50)
    for b, prompt in enumerate(PROMPTS):
        alone = generate(lm, np.array([prompt]), 6, return_logits=True)
        np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0])
        np.testing.assert_allclose(batch.logits[b], alone.logits[0], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(batch.sequences[b], np.r_[prompt, alone.tokens[0]])
    assert batch.stop_reason == ["max_new_tokens"] * 3
    np.testing.assert_array_equal(batch.lengths, [6, 6, 6])


def test_right_padded_array_with_lengths_equals_lists(lm):
    padded = np.full((3, 7), -100)  # garbage past each length is ignored
    for b, p in enumerate(PROMPTS):
        padded[b, : len(p)] = p
    lengths = [len(p) for p in PROMPTS]
    a = generate(lm, jnp.asarray(padded), 6, prompt_lengths=lengths)
    np.testing.assert_array_equal(a.tokens, generate(lm, PROMPTS, 6).tokens)


def test_greedy_with_cache_equals_full_recomputation(lm):
    n = 8
    cached = generate(lm, PROMPTS, n)
    full = _full_logits(lm)
    width = 32  # a fixed-width buffer: causal, so what lies past a position cannot matter
    for b, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for _ in range(n):
            ids = np.zeros((1, width), np.int32)
            ids[0, : len(seq)] = seq
            seq.append(int(np.argmax(full(ids)[0, len(seq) - 1])))
        np.testing.assert_array_equal(cached.tokens[b], seq[len(prompt) :])


def test_each_row_stops_at_its_own_eos(lm):
    free = generate(lm, PROMPTS, 10)
    # An EOS that row 0 emits within 3 tokens and some other row never emits.
    eos = next(
        int(t) for t in free.tokens[0, :3] if any(int(t) not in free.tokens[b] for b in (1, 2))
    )
    out = generate(lm, PROMPTS, 10, eos_id=eos, pad_id=1)
    for b in range(3):
        hits = np.flatnonzero(free.tokens[b] == eos)
        stop = hits[0] + 1 if hits.size else 10
        np.testing.assert_array_equal(out.tokens[b, :stop], free.tokens[b, :stop])
        assert (out.tokens[b, stop:] == 1).all()
        assert out.lengths[b] == stop
        assert out.stop_reason[b] == ("eos" if hits.size else "max_new_tokens")
        assert out.sequences[b][-1] == (eos if hits.size else free.tokens[b, -1])
    assert out.stop_reason[0] == "eos" and out.lengths[0] <= 3
    assert "max_new_tokens" in out.stop_reason, "pick a model where some row never emits eos"


def test_generation_compiles_once_for_any_number_of_tokens(lm):
    decoder, _ = Decoder.for_model(lm)
    generate(lm, PROMPTS, 5)
    traces = dict(decoder.traces)
    sizes = (decoder.prefill._cache_size(), decoder.sample_loop._cache_size())
    long = generate(lm, PROMPTS, 40)
    generate(lm, PROMPTS, 17, eos_id=3)
    assert dict(decoder.traces) == traces
    assert (decoder.prefill._cache_size(), decoder.sample_loop._cache_size()) == sizes
    assert long.tokens.shape == (3, 40)


@pytest.mark.slow(reason="generates through every cache phase: one compile per phase")
def test_long_generation_through_cache_phases_matches_full_forward():
    """A 256-slot cache runs in phases of 128 and 256 slots; rows cross the boundary."""
    model = build_model(ModelConfig(**{**TINY, "max_len": 256}), seed=5)
    assert phases(256) == [128, 256]
    prompts = [list(np.arange(120) % 49 + 1), [3, 4, 5]]
    out = generate(model, prompts, 16, return_logits=True)
    width = 160
    ids = np.zeros((2, width), np.int32)
    for b, seq in enumerate(out.sequences):
        ids[b, : len(seq)] = seq
    full = _full_logits(model)(ids)  # teacher-forced on what was generated
    for b, prompt in enumerate(prompts):
        at = len(prompt) - 1 + np.arange(16)
        np.testing.assert_allclose(out.logits[b], full[b, at], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(out.tokens[b], np.argmax(full[b, at], axis=-1))


@pytest.mark.slow(reason="compiles generation for several cache phases")
def test_a_short_generation_gets_a_cache_of_the_phase_it_needs(monkeypatch):
    """The cache holds the smallest loop phase that fits prompt + new tokens (not the
    whole capacity), and the tokens are those of a generation over the full capacity."""
    from attnlab.decode.api import cache_slots

    assert [cache_slots(n, 1024) for n in (1, 80, 128, 129, 600, 1024)] == [
        128, 128, 128, 256, 1024, 1024
    ]  # fmt: skip
    assert cache_slots(5, 64) == 64 and cache_slots(300, 1000) == 500
    model = build_model(ModelConfig(**{**TINY, "max_len": 1024}), seed=2)
    decoder, params = Decoder.for_model(model)
    prompts = [[3, 4, 5, 6], [7, 8]]
    sizes = []
    real_init = attnlab.kv_cache.init_cache
    monkeypatch.setattr(
        attnlab.kv_cache, "init_cache", lambda *a, **k: sizes.append(a[2]) or real_init(*a, **k)
    )
    out = generate(model, prompts, 12)
    assert sizes == [128]
    monkeypatch.undo()
    # The same greedy loop over a 1024-slot cache, by hand.
    cache = init_cache(model.cfg, 2, 1024)
    ids = np.array([[3, 4, 5, 6], [7, 8, 0, 0]], np.int32)
    logits_BV, cache = decoder.prefill(params, cache, jnp.asarray(ids), jnp.asarray([4, 2]))
    full = decoder.sample_loop(
        params, cache, logits_BV, jax.random.key(0), np.int32(12), np.int32(-1), np.int32(0),
        SamplingConfig().traced(), return_logits=False,
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens, np.asarray(full["tokens_BS"])[:, :12])


@pytest.mark.slow(
    reason="compiles generation for a stacked and an unstacked decoder and encoder-decoder"
)
def test_an_unstacked_model_generates_what_the_stacked_one_does(lm, s2s):
    """``unstacked(model)`` holds the decoder's layers as separate blocks (the argument keeps
    its stacked layers) and generates the same tokens and logits, for both decoder
    architectures; a model whose loop scans its layers comes back as it is."""
    from attnlab.decode import unstacked

    for model, kw in ((lm, {}), (s2s, dict(start_id=1))):
        flat = unstacked(model)
        assert isinstance(flat.decoder.layers, nnx.List)
        assert not isinstance(model.decoder.layers, nnx.List)
        for sampling in (dict(), dict(temperature=0.8, seed=3)):
            a = generate(model, PROMPTS, 9, return_logits=True, **kw, **sampling)
            b = generate(flat, PROMPTS, 9, return_logits=True, **kw, **sampling)
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logits, b.logits, atol=1e-6, rtol=0)
    scanned = build_model(ModelConfig(**TINY, decode_layers="scan"), seed=0)
    assert unstacked(scanned) is scanned


def test_loop_updates_the_cache_in_place(lm):
    """No cache-sized copy or transpose in the compiled loop: the cache layout matches the
    attention dots and the while loop carries the cache in place."""
    decoder, params = Decoder.for_model(lm)
    cache = init_cache(lm.cfg, 3, 64)
    compiled = decoder.sample_loop.lower(
        params, cache, jnp.zeros((3, 50)), jax.random.key(0), np.int32(5), np.int32(-1),
        np.int32(0), SamplingConfig().traced(), return_logits=False,
    ).compile()  # fmt: skip
    size = kv_cache_bytes(lm.cfg, 3, 64, "float32") // (2 * lm.cfg.n_layers * 4)  # one layer
    for line in compiled.as_text().splitlines():
        shape = re.search(r"= f32\[([\d,]+)\]\S* (copy|transpose)\(", line)
        if shape:
            assert math.prod(int(d) for d in shape.group(1).split(",")) < size, line


# ------------------------------------------------------------------------------------------
# Errors before any computation
# ------------------------------------------------------------------------------------------


def test_overflow_raises_before_any_computation(lm):
    decoder, _ = Decoder.for_model(lm)
    traces = dict(decoder.traces)
    long = [list(range(1, 50)) + [1] * 11]  # 60 tokens
    too_long = (
        r"prompt length 60 \(row 0\) \+ max_new_tokens 10 = 70 exceeds ModelConfig.max_len=64"
        r".*on_overflow='stop'"
    )
    with pytest.raises(ValueError, match=too_long):
        generate(lm, long, 10)
    over_cache = (
        r"prompt length 5 \(row 0\) \+ max_new_tokens 20 = 25 exceeds the cache capacity "
        r"max_len=16.*raise max_len \(up to 64\), or pass on_overflow"
    )
    with pytest.raises(ValueError, match=over_cache):
        generate(lm, [[1, 2, 3, 4, 5]], 20, max_len=16)
    with pytest.raises(ValueError, match="alone exceeds"):
        generate(lm, long, 1, max_len=32, on_overflow="stop")
    with pytest.raises(ValueError, match="max_len=65 exceeds ModelConfig.max_len=64"):
        generate(lm, [[1]], 1, max_len=65)
    with pytest.raises(ValueError, match="on_overflow"):
        generate(lm, [[1]], 1, on_overflow="truncate")
    assert dict(decoder.traces) == traces


def test_on_overflow_stop_stops_rows_at_capacity(lm):
    prompts = [list(range(1, 49)) + [1] * 10, [5, 6, 7], [8, 9]]  # 58 tokens: room for 6
    out = generate(lm, prompts, 10, on_overflow="stop")
    assert out.stop_reason == ["capacity", "max_new_tokens", "max_new_tokens"]
    np.testing.assert_array_equal(out.lengths, [6, 10, 10])
    assert (out.tokens[0, 6:] == 0).all() and len(out.sequences[0]) == 64
    ok = generate(lm, prompts, 6)  # fits exactly: the same first tokens
    np.testing.assert_array_equal(out.tokens[:, :6], ok.tokens)


@pytest.mark.parametrize(
    "prompts, match",
    [
        (
            [[1, 2, 3], [4, 50, 6]],
            r"prompt_ids: id 50 at index \(1, 1\) is not a token id.*vocab_size=50",
        ),
        ([[1, -1]], r"prompt_ids: id -1 at index \(0, 1\)"),
        ([[1, 2], []], "prompt row 1 is empty"),
        (np.zeros((2, 3), np.float32), "integer token ids"),
    ],
)
def test_invalid_prompts_are_rejected(lm, prompts, match):
    with pytest.raises(ValueError, match=match):
        generate(lm, prompts, 3)


def test_other_argument_errors(lm, s2s):
    with pytest.raises(ValueError, match="eos_id=50 is outside"):
        generate(lm, [[1]], 2, eos_id=50)
    with pytest.raises(ValueError, match="top_p"):
        generate(lm, [[1]], 2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="start_id is required for encoder-decoder"):
        generate(s2s, [[1]], 2)
    with pytest.raises(ValueError, match="apply to encoder-decoder models"):
        generate(lm, [[1]], 2, start_id=1)
    with pytest.raises(ValueError, match=r"source_ids: id 99 at index \(0, 2\)"):
        generate(s2s, [[1, 2, 99]], 2, start_id=1)
    with pytest.raises(ValueError, match=r"start token 1 \+ max_new_tokens 64 = 65 exceeds"):
        generate(s2s, [[1, 2]], 64, start_id=1)
    with pytest.raises(ValueError, match="num_beams > 1 is deterministic"):
        generate(lm, [[1]], 2, num_beams=2, temperature=1.0)
    with pytest.raises(
        ValueError, match=r"no option \['temprature'\]; the options are .*'temperature'"
    ):
        generate(lm, [[1]], 2, temprature=1.0)


def test_grouped_options_equal_their_keyword_shorthands(lm):
    """``GenerateOptions`` groups and the flat keywords are one set of settings."""
    from attnlab.decode.options import Beams, CacheOptions, GenerateOptions, Stopping
    from attnlab.decode.sampling import SamplingConfig

    grouped = GenerateOptions(
        sampling=SamplingConfig(temperature=0.9, top_k=5), seed=3,
        stop=Stopping(eos_id=None), cache=CacheOptions(max_len=32), return_logits=True,
    )  # fmt: skip
    a = generate(lm, [[1, 2, 3]], 6, options=grouped)
    b = generate(lm, [[1, 2, 3]], 6, temperature=0.9, top_k=5, seed=3, eos_id=None,
                 max_len=32, return_logits=True)  # fmt: skip
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logits, b.logits)
    beams = generate(lm, [[1, 2, 3]], 4, options=GenerateOptions(beams=Beams(num_beams=2)))
    assert beams.scores.shape == (1,)
    # a keyword overrides its group's field and leaves the others
    c = generate(lm, [[1, 2, 3]], 6, options=grouped, seed=4)
    assert not np.array_equal(c.tokens, a.tokens) or not np.array_equal(c.logits, a.logits)


# ------------------------------------------------------------------------------------------
# Encoder-decoder: greedy, recomputation, beams
# ------------------------------------------------------------------------------------------

SOURCES = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def s2s_full(s2s, width=8):
    """``(src, tgt) -> [len(tgt), V]`` logits by one full forward pass, one compile: both
    sides are padded to ``width`` (the source masked, the target causal)."""
    graphdef, params = nnx.split(s2s)
    run = jax.jit(lambda p, s, t, v: nnx.merge(graphdef, p)(s, t, src_valid_BS=v).logits)

    def logits(src, tgt):
        s, t = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
        s[0, : len(src)], t[0, : len(tgt)] = src, tgt
        return np.asarray(run(params, s, t, np.arange(width)[None] < len(src)))[0, : len(tgt)]

    return logits


def _logprob(full, src, tokens, start_id):
    """Summed log-probability of ``tokens`` after ``start_id``."""
    logp = np.asarray(jax.nn.log_softmax(full(src, np.r_[start_id, tokens[:-1]]), axis=-1))
    return float(np.sum(logp[np.arange(len(tokens)), tokens]))


@pytest.mark.slow(reason="compiles encoder-decoder generation with and without a cache")
def test_seq2seq_greedy_equals_full_recomputation(s2s, s2s_full):
    out = generate(s2s, SOURCES, 6, start_id=1, return_logits=True)
    assert out.tokens.shape == (2, 6) and out.logits.shape == (2, 6, 50)
    for b, src in enumerate(SOURCES):
        tgt = [1]
        for _ in range(6):
            tgt.append(int(np.argmax(s2s_full(src, tgt)[-1])))
        np.testing.assert_array_equal(out.tokens[b], tgt[1:])
        np.testing.assert_array_equal(out.sequences[b], tgt)
        np.testing.assert_allclose(out.logits[b], s2s_full(src, tgt[:-1]), atol=1e-5, rtol=0)


@pytest.mark.slow(reason="compiles encoder-decoder beam search for several beam counts")
def test_beam_search_one_beam_is_greedy_and_more_beams_score_higher(s2s, s2s_full):
    greedy = generate(s2s, SOURCES, 6, start_id=1, return_logits=True)
    np.testing.assert_array_equal(_one_beam(s2s, SOURCES, 6), greedy.tokens)
    beams = generate(s2s, SOURCES, 6, start_id=1, num_beams=4, length_penalty=0.0)
    gains = []
    for b, src in enumerate(SOURCES):
        g = _logprob(s2s_full, src, greedy.tokens[b], 1)
        w = _logprob(s2s_full, src, beams.tokens[b], 1)
        np.testing.assert_allclose(beams.scores[b], w, atol=1e-4)
        gains.append(w - g)
    assert min(gains) >= -1e-5 and max(gains) > 0.1  # never worse; better on this model
    assert beams.stop_reason == ["max_new_tokens"] * 2


def _one_beam(model, rows, n):
    """The beam loop itself with one beam (``generate`` samples greedily for num_beams=1)."""
    decoder, params = Decoder.for_model(model)
    B, width = len(rows), 16
    ids = np.zeros((B, width), np.int32)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    cache = init_cache(model.cfg, B, 64)
    if decoder.seq2seq:
        valid = np.arange(width)[None] < np.asarray(lengths)[:, None]
        cache = decoder.encode(params, cache, jnp.asarray(ids), jnp.asarray(valid))
        ids, lengths = np.ones((B, 1), np.int32), jnp.ones((B,), jnp.int32)
    logits_BV, cache = decoder.prefill(params, cache, jnp.asarray(ids), lengths)
    args = (np.int32(n), np.int32(-1), np.int32(0), np.float32(1.0))
    out = decoder.beam_loop(params, cache, logits_BV, *args, num_beams=1)
    return np.asarray(out["tokens_BS"])[:, :n]


def test_decoder_only_beam_search(lm):
    """Beams start from the prefilled ragged prompts: one beam is greedy, four never score
    below greedy, and every score is the sequence's log-probability under a full pass."""
    greedy = generate(lm, PROMPTS, 6)
    np.testing.assert_array_equal(_one_beam(lm, PROMPTS, 6), greedy.tokens)
    beams = generate(lm, PROMPTS, 6, num_beams=4, length_penalty=0.0)
    full = _full_logits(lm)

    def logprob(prompt, tokens):
        ids = np.zeros((1, 32), np.int32)
        seq = np.r_[prompt, tokens]
        ids[0, : len(seq)] = seq
        logp = np.asarray(jax.nn.log_softmax(full(ids)[0], axis=-1))
        at = len(prompt) - 1 + np.arange(len(tokens))
        return float(np.sum(logp[at, tokens]))

    gains = []
    for b, prompt in enumerate(PROMPTS):
        w = logprob(prompt, beams.tokens[b])
        np.testing.assert_allclose(beams.scores[b], w, atol=1e-4)
        np.testing.assert_array_equal(beams.sequences[b], np.r_[prompt, beams.tokens[b]])
        gains.append(w - logprob(prompt, greedy.tokens[b]))
    assert min(gains) >= -1e-5 and max(gains) > 0.1
    assert beams.stop_reason == ["max_new_tokens"] * 3


def test_beam_search_stops_at_eos(s2s):
    free = generate(s2s, SOURCES, 6, num_beams=4, start_id=1)
    eos = int(free.tokens[0, 1])
    out = generate(s2s, SOURCES, 6, num_beams=4, start_id=1, eos_id=eos)
    for b in range(2):
        if out.stop_reason[b] == "eos":
            n = out.lengths[b]
            assert out.tokens[b, n - 1] == eos and (out.tokens[b, n:] == 0).all()
            assert eos not in out.tokens[b, : n - 1]
        else:
            assert eos not in out.tokens[b]


def test_zero_new_tokens(lm, s2s):
    out = generate(lm, PROMPTS, 0)
    assert out.tokens.shape == (3, 0) and out.stop_reason == ["max_new_tokens"] * 3
    np.testing.assert_array_equal(out.sequences[1], PROMPTS[1])
    beams = generate(s2s, SOURCES, 0, num_beams=4, start_id=1, eos_id=2)
    assert beams.tokens.shape == (2, 0) and list(beams.lengths) == [0, 0]


@pytest.mark.slow(
    reason="compiles bfloat16 generation; float32 decoding is checked in the fast tier"
)
def test_bfloat16_decoding_follows_the_float32_model():
    """``generate(dtype="bfloat16")``: weights cast once, cache and activations in bf16;
    its logits stay within bf16 rounding of the float32 ones, and the caller's model
    keeps its float32 weights."""
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=50,
                      max_len=64, position="rope", norm="rmsnorm", ffn="swiglu")  # fmt: skip
    model = build_model(cfg, seed=3)
    ids = np.random.default_rng(0).integers(1, 50, (2, 7))
    full = attnlab.generate(model, ids, 6, return_logits=True)
    half = attnlab.generate(model, ids, 6, return_logits=True, dtype="bfloat16")
    scale = np.abs(full.logits).max()
    assert 0 < np.abs(half.logits - full.logits).max() < 0.02 * scale
    assert half.logits.dtype == np.float32
    assert model.decoder.layers.attn.q_DNH[...].dtype == jnp.float32
    with pytest.raises(attnlab.errors.DecodeError, match="dtype"):
        attnlab.generate(model, ids, 2, dtype="float8")


def test_a_transposed_weight_contracts_as_the_original():
    """``ops.Transposed`` holds a weight output axes first (the original's axes moved,
    bitwise back); ``dense`` contracts it as it would the original: float64 NumPy
    ``einsum`` for one and two input axes."""
    from attnlab.ops import Transposed, dense

    rng = np.random.default_rng(0)
    x, w2, w1 = rng.normal(size=(2, 3, 4, 5)), rng.normal(size=(4, 5, 6)), rng.normal(size=(5, 7))
    t2 = Transposed.of(jnp.asarray(w2, jnp.float32), 2)
    assert t2.t.shape == (6, 4, 5) and t2.shape == (4, 5, 6)
    np.testing.assert_array_equal(t2.original(), np.float32(w2))
    x32 = jnp.asarray(x, jnp.float32)
    np.testing.assert_allclose(dense(x32, t2, n_in=2), np.einsum("btnh,nhd->btd", x, w2),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    t1 = Transposed.of(jnp.asarray(w1, jnp.float32))
    np.testing.assert_allclose(dense(x32, t1), x @ w1, rtol=1e-5, atol=1e-5)


@pytest.mark.slow(reason="compiles generation for the transposed model (the layout: above)")
def test_weights_stored_output_axes_first_generate_what_the_model_does(lm):
    """``unstacked(model, out_in=True)`` stores attention's and the FFN's weights output axes
    first (``ops.Transposed``), and greedy generation gives the model's tokens and logits."""
    from attnlab.decode import unstacked
    from attnlab.ops import Transposed

    flat = unstacked(lm, out_in=True)
    layer = flat.decoder.layers[0]
    q = layer.attn.q_DNH.get_value()
    assert isinstance(q, Transposed) and q.shape == lm.decoder.layers.attn.q_DNH.shape[1:]
    np.testing.assert_array_equal(q.original(), lm.decoder.layers.attn.q_DNH[...][0])
    assert isinstance(layer.ffn.w_out_FD.get_value(), Transposed)
    a = generate(lm, PROMPTS, 9, return_logits=True)
    b = generate(flat, PROMPTS, 9, return_logits=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-5, rtol=0)
