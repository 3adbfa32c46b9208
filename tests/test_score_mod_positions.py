"""Score functions see the tokens' absolute positions on every path: cached decoding equals
recomputing the whole sequence.

A score function reads ``q_idx`` and ``kv_idx`` (``attnlab.ops.score_mods``). Whatever the
cache does with the keys (a ring buffer of W slots that wraps, a linear cache, ragged rows,
a prefill in chunks that attend over the ring and then their own keys, a speculative pass
that rolls the lengths back), a query at position p and a key at position j must see p and
j: so every logit of cached decoding equals the full forward pass's over the same tokens
(its mask holds the same window). The property runs over the built-in score functions,
user functions of ``q_idx - kv_idx``, ``kv_idx`` alone and ``q_idx`` alone, and every
registered mixer, decoding more than 3 windows past the prompt.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiers import cases

import attnlab
from attnlab import ModelConfig, build_model, init_cache
from attnlab.contracts.mixer import get_mixer, registered_mixers
from attnlab.decode.speculative import speculative_generate
from attnlab.errors import ConfigError
from attnlab.kv_cache import LayerCache, Ring
from attnlab.ops import score_mods
from attnlab.ops.attention import dot_product_attention

F32 = jnp.float32
W, T = 4, 20  # the window; the tokens each row reaches (positions 0..19: 4 windows)
PROMPTS = np.array([3, 6], np.int32)  # ragged rows, prefilled in chunks of CHUNK tokens
CHUNK = 2
N_HEADS = 4
BASE = dict(vocab_size=50, d_model=16, n_layers=2, n_heads=N_HEADS, n_kv_heads=2, max_len=T,
            init_std=0.3, sliding_window=W)  # fmt: skip
ATOL = 1e-5  # float32 logits


def _forget(B):
    """A cumulative log forget gate over positions, ``[B, N, T]`` (FoX's score function)."""
    steps_NT = -jax.nn.softplus(jnp.sin(jnp.arange(N_HEADS * T, dtype=F32)).reshape(N_HEADS, T))
    return jnp.broadcast_to(jnp.cumsum(steps_NT, axis=1)[None], (B, N_HEADS, T))


# Each builds the score function of a call from its query batch (some close over arrays).
SCORE_FUNCTIONS = {
    "distance": lambda B: lambda s, b, h, q, k: s - 0.4 * (q - k).astype(F32),
    # All three at once, for the mixers: a row's constant in q_idx does not change softmax.
    "mixed": lambda B: (
        lambda s, b, h, q, k: (
            s * (1.0 + 0.2 * q.astype(F32))
            - 0.4 * (q - k).astype(F32)
            + jnp.sin(0.9 * k.astype(F32))
        )
    ),
    "key": lambda B: lambda s, b, h, q, k: s + 2.0 * jnp.sin(0.9 * k.astype(F32)),
    "query": lambda B: lambda s, b, h, q, k: s * (1.0 + 0.2 * q.astype(F32)),
    "alibi": lambda B: score_mods.alibi(jnp.array([0.5, 0.25, 0.125, 0.0625])),
    "forget_gate": lambda B: score_mods.forget_gate(_forget(B)),
    "head_bias": lambda B: score_mods.head_bias(jnp.array([0.3, -0.2, 0.1, 0.0])),
    "softcap": lambda B: score_mods.softcap(0.5),
}


def _register(name):
    """The attention function ``positions_<name>``: softmax attention with the score function."""

    def attend(q, k, v, *, score_mod=None, **kw):  # after a mixer's own (FoX's gate)
        mine = SCORE_FUNCTIONS[name](q.shape[0])
        mod = score_mods.compose(score_mod, mine) if score_mod is not None else mine
        return dot_product_attention(q, k, v, score_mod=mod, **kw)

    attnlab.register_attention(f"positions_{name}", attend, overwrite=True)
    return f"positions_{name}"


def cached_against_full(cfg, kinds=(True, False), seed=0):
    """Per cache kind (True: a ring of W slots, False: linear): the largest difference
    between cached logits and the full forward pass's, over a prefill of the ragged prompts
    in chunks of ``CHUNK`` tokens and single-token steps up to position T - 1 of each row."""
    model = build_model(cfg, seed=seed)
    graphdef, params = nnx.split(model)
    B = len(PROMPTS)
    ids_BT = jax.random.randint(jax.random.key(seed + 1), (B, T), 1, cfg.vocab_size)
    prompt_B = jnp.asarray(PROMPTS)
    rows = jnp.arange(B)

    @jax.jit
    def run(params):
        model = nnx.merge(graphdef, params)
        full_BTV = model(ids_BT).logits
        errors = []
        for ring in kinds:
            cache = init_cache(cfg, B, T, ring=ring)
            assert cache.ring == ring
            err = jnp.float32(0)
            for start in range(0, int(PROMPTS.max()), CHUNK):  # chunked, ragged prefill
                t_1C = start + jnp.arange(CHUNK)[None, :]
                valid_BC = t_1C < prompt_B[:, None]
                out = model(ids_BT[:, start : start + CHUNK], valid_BT=valid_BC, cache=cache)
                cache = out.cache
                diff = jnp.abs(out.logits - full_BTV[:, start : start + CHUNK])
                err = jnp.maximum(err, jnp.max(jnp.where(valid_BC[..., None], diff, 0.0)))

            def step(cache, i):  # each row one token further, at its own position
                pos_B = jnp.minimum(prompt_B + i, T - 1)
                live_B = prompt_B + i <= T - 1
                out = model(ids_BT[rows, pos_B][:, None], valid_BT=live_B[:, None], cache=cache)
                diff = jnp.abs(out.logits[:, 0] - full_BTV[rows, pos_B])
                return out.cache, jnp.max(jnp.where(live_B[:, None], diff, 0.0))

            cache, step_err = jax.lax.scan(step, cache, jnp.arange(T - int(PROMPTS.min())))
            assert jnp.shape(cache.lengths) == (B,)
            errors.append(jnp.maximum(err, step_err.max()))
        return jnp.stack(errors), cache.lengths

    errors, lengths = run(params)
    np.testing.assert_array_equal(lengths, [T, T])  # every row went to the end
    return dict(zip(kinds, np.asarray(errors).tolist(), strict=True))


@pytest.mark.parametrize(
    "name",
    cases(
        list(SCORE_FUNCTIONS),
        slow={
            n: "one more model compiled with two caches"
            for n in ("mixed", "alibi", "forget_gate", "head_bias", "softcap")
        },
    ),
)
def test_cached_decoding_equals_recompute_for_every_score_function(name):
    """Ring and linear caches, chunked and ragged prefill, 14+ single steps past a window of
    4: each logit as the full forward pass gives it (on main, the ring gave 6e-2 to 1.4 for
    the user functions of ``kv_idx``)."""
    cfg = ModelConfig(**BASE, attention_fn=_register(name))
    errors = cached_against_full(cfg)
    assert max(errors.values()) < ATOL, errors


# Mixers that refuse a ring (they keep per-position state a ring would drop) or a window.
LINEAR_ONLY = {"fox": "decodes with a linear cache"}
NO_WINDOW = {"moba", "nsa"}  # they choose their own keys over a linear cache
# The library's mixers: not those another test file registers when it is collected (such
# as a training-only variant whose score function reads a per-call array by q_idx).
BUILT_IN = sorted(m for m in registered_mixers() if get_mixer(m).__module__.startswith("attnlab."))


@pytest.mark.parametrize(
    "mixer",
    cases(
        BUILT_IN,
        slow={
            m: "one more mixer compiled with its caches"
            for m in BUILT_IN
            if m not in ("mha", "fox")
        },
    ),
)
def test_cached_decoding_equals_recompute_for_every_mixer(mixer):
    """Every registered mixer, its attention given a user score function of ``q_idx``,
    ``kv_idx`` and their difference (variants without softmax attention ignore it): cached
    decoding through each cache the mixer takes equals recomputation."""
    cfg = dict(BASE, mixer=mixer, attention_fn=_register("mixed"))
    if mixer in NO_WINDOW:
        cfg["sliding_window"] = None
    kinds = (False,) if mixer in LINEAR_ONLY or mixer in NO_WINDOW else (True, False)
    errors = cached_against_full(ModelConfig(**cfg), kinds=kinds)
    assert max(errors.values()) < ATOL, errors


def test_a_mixer_that_refuses_the_ring_says_so():
    with pytest.raises(ConfigError, match=LINEAR_ONLY["fox"]):
        cached_against_full(ModelConfig(**BASE, mixer="fox"), kinds=(True,))


@pytest.mark.slow(reason="compiles an MTP model's speculative loop and recomputation (~40 s)")
def test_speculative_verification_sees_positions():
    """Speculative decoding rolls each row's length back and verifies K + 1 tokens over a
    linear cache: the pass's logits equal the full forward pass's, and the tokens the
    greedy decoding's (by recomputation)."""
    cfg = ModelConfig(**dict(BASE, sliding_window=None, mtp_depth=2),
                      attention_fn=_register("distance"))  # fmt: skip
    model = build_model(cfg, seed=3)
    ids_BT = jax.random.randint(jax.random.key(4), (2, 12), 1, cfg.vocab_size)
    full_BTV = model(ids_BT).logits
    cache = model(ids_BT[:, :9], cache=init_cache(cfg, 2, T)).cache
    back = model(ids_BT[:, 6:9], cache=cache.replace(lengths=jnp.full((2,), 6, jnp.int32)))
    np.testing.assert_allclose(back.logits, full_BTV[:, 6:9], atol=ATOL, rtol=0)
    prompt = np.asarray(ids_BT[:, :5])
    got = speculative_generate(model, prompt, 8, depth=2)
    want = attnlab.generate(model, prompt, 8, recompute=True, eos_id=None)
    np.testing.assert_array_equal(got.tokens, np.asarray(want.tokens))


def test_key_index_finds_a_position_among_the_keys_a_call_attends():
    """``LayerCache.key_index`` maps each key's position back to its index among the keys a
    call attends over (a variant's per-key array is laid out so): a linear cache's slots, a
    ring stepped in place, a longer call over a ring (the ring, then its own keys)."""
    start_B, b = jnp.array([9, 2], jnp.int32), jnp.arange(2)[:, None]
    for T_call in (1, 3):
        ring = Ring(start_B, jnp.full((2,), T_call, jnp.int32), W)
        layer = LayerCache({}, jnp.int32(0), ring.start_B, ring.count_B, ring=ring)
        k_pos_BS, _ = ring.keys(T_call, (W,))
        held = np.asarray(k_pos_BS) >= 0  # slots that hold a key
        got = np.asarray(layer.key_index(b, k_pos_BS, T_call))
        want = np.broadcast_to(np.arange(k_pos_BS.shape[1]), k_pos_BS.shape)
        np.testing.assert_array_equal(got[held], want[held])
    linear = LayerCache({}, jnp.int32(0), start_B, jnp.full((2,), 3, jnp.int32))
    np.testing.assert_array_equal(linear.key_index(b, jnp.arange(12)[None, :], 3), [range(12)])
