"""The recurrent-state mixers, Gated DeltaNet (``gated_deltanet``) and Mamba-2 (``mamba2``):
their three forms against the papers' equations in float64, the modules against
transformers' own torch layers on the same weights, prefills split anywhere, padding, cached
decoding of a whole decoder, training, their cache entries and their settings' errors."""

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import reference
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import cases

import attnlab
from attnlab import ModelConfig, build_model, kv_cache
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.errors import ConfigError
from attnlab.ops import MaskSpec, deltanet, ssd
from attnlab.ops.recurrent import causal_conv

SETTINGS = {
    "gated_deltanet": {"num_k_heads": 2, "head_v_dim": 4, "chunk_size": 4},
    "mamba2": {"state_size": 4, "n_groups": 2, "head_dim": 8, "chunk_size": 4},
}
MIXERS = list(SETTINGS)
# The fast tier runs each model-level check for one of the two layers, the slow tier both.
COMPILES = "compiles a model of its own; the other layer runs this check in the fast tier"
ONLY_GDN = cases(MIXERS, slow={"mamba2": COMPILES})
ONLY_MAMBA2 = cases(MIXERS, slow={"gated_deltanet": COMPILES})


def tiny(mixer, **changes):
    base = dict(mixer_checks.TINY, position="none", mixer=mixer, mixer_settings=SETTINGS[mixer])
    return ModelConfig(**{**base, **changes})


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def steps_one_by_one(step, inputs, state):
    """The one-token step applied token after token (as a decode loop does)."""
    outs = []
    for t in range(inputs[0].shape[1]):
        out, state = step(*(a[:, t] for a in inputs), state)
        outs.append(out)
    return jnp.stack(outs, axis=1), state


def delta_rule_inputs(rng, B, T, N, H, J):
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(B, T, N, H))) * H**-0.5
    k = unit(rng.normal(size=(B, T, N, H)))
    v = rng.normal(size=(B, T, N, J))
    g, beta = -rng.uniform(0, 1.5, (B, T, N)), rng.uniform(0, 1, (B, T, N))
    return (q, k, v, g, beta), reference.gated_delta_rule


def ssd_inputs(rng, B, T, N, H, J):
    x, A = rng.normal(size=(B, T, N, H)), -rng.uniform(0.5, 4, N)
    dt = rng.uniform(0.01, 0.5, (B, T, N))
    b, c = rng.normal(size=(B, T, N, J)), rng.normal(size=(B, T, N, J))
    return (x, dt, A, b, c), reference.selective_state_space


FORMS = {
    "gated_delta_rule": (
        delta_rule_inputs,
        deltanet.delta_rule_chunked,
        deltanet.delta_rule_recurrent,
        deltanet.delta_rule_step,
    ),
    "ssd": (ssd_inputs, ssd.ssd_chunked, ssd.ssd_recurrent, ssd.ssd_step),
}


@pytest.mark.parametrize("rule", list(FORMS))
def test_chunked_step_and_scan_equal_the_float64_equations(rule):
    """From a non-zero state, over 19 tokens (not a whole number of chunks): the chunked form
    (chunks of 4 and 64), the one-token step in a loop and the per-token scan all equal the
    paper's recurrence in float64 to 1e-5 relative, outputs and final state."""
    make, chunked, recurrent, step = FORMS[rule]
    rng = np.random.default_rng(0)
    B, T, N, H, J = 2, 19, 3, 8, 5
    inputs, equations = make(rng, B, T, N, H, J)
    state0 = rng.normal(size=(B, N, H, J)) * 0.3
    want_out, want_state = equations(*inputs, state0)
    args = [jnp.asarray(a, jnp.float32) for a in (*inputs, state0)]
    per_token = lambda *a: step(*a[:2], args[2], *a[2:]) if rule == "ssd" else step(*a)
    token_args = [a for i, a in enumerate(args[:-1]) if not (rule == "ssd" and i == 2)]
    forms = {
        "chunked_4": chunked(*args, chunk_size=4),
        "chunked_64": chunked(*args, chunk_size=64),
        "scan": recurrent(*args),
        "step": steps_one_by_one(jax.jit(per_token), token_args, args[-1]),
    }
    for name, (out, state) in forms.items():
        assert out.dtype == jnp.float32 and state.dtype == jnp.float32
        assert rel(out, want_out) <= 1e-5, (name, rel(out, want_out))
        assert rel(state, want_state) <= 1e-5, (name, rel(state, want_state))


def test_the_chunked_delta_rule_holds_through_a_run_of_equal_keys():
    """Filler tokens repeat one key: the chunk's ``I + L`` is then near a lower matrix of
    ones. The chunked form still equals the float64 recurrence over a 64-token chunk (the
    inverse by repeated squaring was off by 4e15 here)."""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(1, 128, 2, 16))
    k[:, 20:] = k[:, 20:21]
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    inputs = (k * 16**-0.5, k, rng.normal(size=(1, 128, 2, 16)),
              np.full((1, 128, 2), -1e-3), np.full((1, 128, 2), 0.99))  # fmt: skip
    o, state = deltanet.delta_rule_chunked(*(jnp.asarray(x, jnp.float32) for x in inputs))
    want_o, want_state = reference.gated_delta_rule(*inputs)
    assert rel(o, want_o) < 1e-5 and rel(state, want_state) < 1e-5


def test_causal_conv_carries_its_inputs_and_skips_pad_tokens():
    rng = np.random.default_rng(1)
    x, w, bias = rng.normal(size=(2, 7, 6)), rng.normal(size=(4, 6)), rng.normal(size=6)
    state = rng.normal(size=(2, 3, 6))
    f = lambda a: jnp.asarray(a, jnp.float32)
    y, new = causal_conv(f(x), f(w), f(bias), f(state))
    assert rel(y, reference.causal_depthwise_conv(x, w, bias, state)) <= 1e-6
    np.testing.assert_array_equal(new, f(x[:, -3:]))
    # A right-padded prefix (5 and 1 real tokens): the state ends at each row's last one.
    valid = jnp.arange(7)[None, :] < jnp.array([[5], [1]])
    _, new = causal_conv(f(x), f(w), None, f(state), valid)
    np.testing.assert_array_equal(new[0], f(x[0, 2:5]))
    np.testing.assert_array_equal(new[1], f(np.concatenate([state[1, 1:], x[1, :1]])))


def mixer_module(cfg, seed=0):
    return get_mixer(cfg.mixer)(cfg, cfg.mixer_settings, rngs=nnx.Rngs(seed))


def plain_call(B, T, valid_BT=None):
    positions = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    return MixerCall(positions, mask=MaskSpec.for_sequence(T, causal=True, k_valid=valid_BT))


def one_layer_cache(cfg, B, start_B, count_B, entries=None):
    """Layer 0 of a cache as the stack hands it to a mixer (a one-layer model's)."""
    cache = attnlab.init_cache(cfg, B, cfg.max_len)
    layers = cache.layers if entries is None else entries
    return kv_cache.LayerCache(layers, jnp.int32(0), start_B, count_B, None, cache.slot_axes)


def prefill_then_steps(module, cfg, x_BTD, P):
    """``module`` over ``x`` through a one-layer cache: a prefill of ``P`` tokens, then one
    token at a time (jitted). Returns the outputs ``[B, T, D]`` and the final entries."""
    graphdef, params = nnx.split(module)
    B, T, _ = x_BTD.shape

    @jax.jit
    def run(params, x_BTD):
        module, entries, outs = nnx.merge(graphdef, params), None, []
        for start, stop in [(0, P)] + [(t, t + 1) for t in range(P, T)]:
            count = jnp.full((B,), stop - start, jnp.int32)
            view = one_layer_cache(cfg, B, jnp.full((B,), start, jnp.int32), count, entries)
            positions = jnp.zeros((B, stop - start), jnp.int32)
            out, view, _ = module(x_BTD[:, start:stop], MixerCall(positions, cache=view))
            entries, outs = view.layers, outs + [out]
        return jnp.concatenate(outs, axis=1), entries

    return run(params, x_BTD)


@pytest.mark.slow(reason="runs a layer twice; the fast tier checks the bfloat16 entries' layout")
@pytest.mark.parametrize("mixer", MIXERS)
def test_a_bfloat16_state_decodes_close_to_the_float32_one(mixer):
    """``state_dtype="bfloat16"`` keeps both entries in bfloat16 (the maths stays float32):
    a prefill of 6 tokens and 3 steps stay within 2e-2 of the float32 state's outputs."""
    x = jax.random.normal(jax.random.key(7), (2, 9, 16))
    outs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = tiny(mixer, d_model=16, n_layers=1,
                   mixer_settings={**SETTINGS[mixer], "state_dtype": dtype})  # fmt: skip
        outs[dtype], entries = prefill_then_steps(mixer_module(cfg, seed=4), cfg, x, 6)
        assert {a.dtype for a in entries.values()} == {jnp.dtype(dtype)}
    assert 0 < rel(outs["bfloat16"], outs["float32"]) <= 2e-2


# --------------------------------------------------------------------------------------------
# Prefill split anywhere, then decoding, through the cache
# --------------------------------------------------------------------------------------------

# The fast tier draws a few split points, the slow tier many.
SPLIT = settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _split_runner(mixer):
    """A jitted function of each row's split point: the whole prompt in one prefill, or in
    two (each right-padded to the prompt's length, so one program serves every split), then
    three decode steps. Returns both runs' outputs at real tokens and final caches."""
    cfg = tiny(mixer, n_layers=1, d_model=16)
    module = mixer_module(cfg, seed=3)
    B, P, steps = 2, 10, 3
    x_BTD = jax.random.normal(jax.random.key(5), (B, P + steps, cfg.d_model))

    def call(cache):  # positions play no part in a recurrent layer
        return MixerCall(jnp.zeros((B, 1), jnp.int32), cache=cache)

    def decode(entries, start_B):
        outs = []
        for i in range(steps):
            view = one_layer_cache(cfg, B, start_B + i, jnp.ones((B,), jnp.int32), entries)
            out, view, _ = module(x_BTD[:, P + i : P + i + 1], call(view))
            entries, outs = view.layers, outs + [out]
        return entries, jnp.concatenate(outs, axis=1)

    @jax.jit
    def run(split_B):
        zero_B = jnp.zeros((B,), jnp.int32)
        whole = one_layer_cache(cfg, B, zero_B, jnp.full((B,), P, jnp.int32))
        one_out, whole, _ = module(x_BTD[:, :P], call(whole))
        one_entries, one_steps = decode(whole.layers, zero_B + P)
        first = one_layer_cache(cfg, B, zero_B, split_B)
        out_a, first, _ = module(x_BTD[:, :P], call(first))
        # The rest of each row, moved to the front of the second call.
        rest_BTD = jax.vmap(lambda x, s: jnp.roll(x, -s, axis=0))(x_BTD[:, :P], split_B)
        second = one_layer_cache(cfg, B, split_B, P - split_B, first.layers)
        out_b, second, _ = module(rest_BTD, call(second))
        two_entries, two_steps = decode(second.layers, zero_B + P)
        back = jax.vmap(lambda x, s: jnp.roll(x, s, axis=0))(out_b, split_B)
        t_BT = jnp.arange(P)[None, :]
        two_out = jnp.where((t_BT < split_B[:, None])[..., None], out_a, back)
        return (one_out, one_steps, one_entries), (two_out, two_steps, two_entries)

    return run, P


def _split_anywhere(mixer, examples):
    """Each row's prompt of 10 tokens split at a drawn point (0 and 10 included) and
    prefilled in two calls, then decoded 3 tokens: outputs at every real token and the final
    state and conv entries equal one prefill's, to 1e-5."""
    run, P = _split_runner(mixer)

    @settings(SPLIT, max_examples=examples)
    @given(st.lists(st.integers(0, P), min_size=2, max_size=2))
    def check(splits):
        one, two = run(jnp.asarray(splits, jnp.int32))
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    check()


@pytest.mark.slow(reason="draws 25 split points per layer; the fast tier splits a decoder's")
@pytest.mark.parametrize("mixer", MIXERS)
def test_a_prefill_split_anywhere_then_decoded_equals_one_prefill(mixer):
    _split_anywhere(mixer, 25)


def _decoder_split_runner(mixer):
    """As ``_split_runner`` for a whole decoder through ``Decoder.prefill_fn`` and
    ``decode_step_fn``: one prefill, two prefills split at each row's drawn point, and the
    library's chunked prefill (chunks of 3 tokens), each then decoding 3 tokens. Returns,
    for each, the logits at the last prompt token and at every step, and the final cache."""
    from attnlab.decode import Decoder

    cfg = tiny(mixer)
    decoder, params = Decoder.for_model(build_model(cfg, seed=6))
    B, P, steps = 2, 8, 3
    ids_BT = jax.random.randint(jax.random.key(8), (B, P + steps), 1, cfg.vocab_size)
    full_B = jnp.full((B,), P, jnp.int32)

    def decode(cache, first_BV):
        logits = [first_BV]
        for i in range(steps):
            logits_BV, cache = decoder.decode_step_fn(params, cache, ids_BT[:, P + i])
            logits.append(logits_BV)
        return jnp.stack(logits, 1), cache.layers, cache.lengths

    @jax.jit
    def run(split_B):
        fresh = lambda: attnlab.init_cache(cfg, B, cfg.max_len)
        one = decode(*reversed(decoder.prefill_fn(params, fresh(), ids_BT[:, :P], full_B)))
        chunked = decoder.prefill_fn(params, fresh(), ids_BT[:, :P], full_B, chunk=3)
        first_BV, cache = decoder.prefill_fn(params, fresh(), ids_BT[:, :P], split_B)
        rest_BP = jax.vmap(lambda x, s: jnp.roll(x, -s))(ids_BT[:, :P], split_B)
        second_BV, cache = decoder.prefill_fn(params, cache, rest_BP, P - split_B)
        last_BV = jnp.where((split_B == P)[:, None], first_BV, second_BV)
        return one, decode(*reversed(chunked)), decode(cache, last_BV)

    return run, P


def _decoder_split(mixer, examples):
    """A whole decoder: a prompt prefilled in two pieces split at drawn points (per row), or
    in the library's chunks, then decoded: logits and final cache equal one prefill's."""
    run, P = _decoder_split_runner(mixer)

    @settings(SPLIT, max_examples=examples)
    @given(st.lists(st.integers(0, P), min_size=2, max_size=2))
    def check(splits):
        one, chunked, two = run(jnp.asarray(splits, jnp.int32))
        for other in (chunked, two):
            for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(other), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    check()


@pytest.mark.parametrize("mixer", ONLY_MAMBA2)
def test_a_decoder_prefilled_in_pieces_decodes_as_one_prefill(mixer):
    _decoder_split(mixer, 3)


@pytest.mark.slow(reason="draws 15 split points per layer, each a whole decoder's run")
@pytest.mark.parametrize("mixer", MIXERS)
def test_a_decoder_prefilled_in_pieces_decodes_as_one_prefill_all(mixer):
    _decoder_split(mixer, 15)


# --------------------------------------------------------------------------------------------
# A whole decoder: padding, cached decoding, training, cache entries, settings
# --------------------------------------------------------------------------------------------

SLOW_MODEL = pytest.mark.slow(reason="compiles a decoder's prefill, step and generation loops")


@pytest.mark.parametrize("mixer", ONLY_MAMBA2)
def test_left_padding_changes_nothing_at_real_tokens(mixer):
    """A row left-padded by 3 tokens (arbitrary ids at the pads) gives, at its real tokens,
    the logits of the same tokens unpadded (the other row, whose last 3 tokens come after
    and change nothing before them): pad tokens leave the state and conv untouched."""
    graphdef, params = nnx.split(build_model(tiny(mixer), seed=1))
    ids = jnp.array([[9, 1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8, 9, 1, 2]])
    valid = jnp.array([[False] * 3 + [True] * 6, [True] * 9])
    logits = jax.jit(lambda p: nnx.merge(graphdef, p)(ids, valid_BT=valid).logits)(params)
    np.testing.assert_allclose(logits[0, 3:], logits[1, :6], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", ONLY_GDN)
def test_a_decoder_decodes_ragged_prompts_like_its_forward_pass(mixer):
    """Ragged prompts (3 and 6 tokens) prefilled into the cache, then decoded token by token:
    every logit equals one full forward pass's (``mixer_checks.prefill_then_steps``)."""
    mixer_checks.prefill_then_steps(tiny(mixer), atol=1e-5)


@SLOW_MODEL
@pytest.mark.parametrize("mixer", MIXERS)
def test_generation_and_beams_through_the_cache_equal_recomputation(mixer):
    """``attnlab.generate`` on a ragged batch: greedy tokens through the cache equal those of
    recomputing the prefix, beam scores equal one forward pass's log-probabilities (beams
    reorder the state rows), and masked rows keep gradients finite."""
    cfg = tiny(mixer)
    mixer_checks.generate_matches_recompute(cfg)
    mixer_checks.beam_scores_match_forward(cfg)
    mixer_checks.grads_finite_with_masked_rows(cfg)


@pytest.mark.slow(reason="compiles a decoder's gradient step; the cached checks cover the layers")
@pytest.mark.parametrize("mixer", MIXERS)
def test_training_a_few_steps_lowers_the_loss(mixer):
    import optax

    model = build_model(tiny(mixer, n_layers=1), seed=0)
    graphdef, params = nnx.split(model)
    ids = jax.random.randint(jax.random.key(0), (4, 12), 1, 50)

    def loss_fn(params):
        logits = nnx.merge(graphdef, params)(ids[:, :-1]).logits
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    opt = optax.adam(3e-3)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = opt.init(params), []
    for _ in range(8):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_entries_are_fixed_size_state_named_by_role(mixer, dtype):
    cfg = tiny(mixer, mixer_settings={**SETTINGS[mixer], "state_dtype": dtype})
    s = cfg.mixer_settings.resolved(cfg)
    if mixer == "gated_deltanet":
        state, channels = (4, 8, 4), 2 * 2 * 8 + 4 * 4  # N=4 value heads, H=8, J=4
    else:
        state, channels = (8, 8, 4), 64 + 2 * 2 * 4  # I = 2 * 32 = 8 heads of 8, J=4, G=2
    assert (s.conv_kernel, type(cfg.mixer_settings).__name__) == (4, "Settings")
    cache = attnlab.init_cache(cfg, 3, 16)
    assert cache.layers["state"].shape == (2, 3, *state)
    assert cache.layers["conv"].shape == (2, 3, 3, channels)
    assert {a.dtype for a in cache.layers.values()} == {jnp.dtype(dtype)}
    per_row = 2 * (np.prod(state) + 3 * channels) * jnp.dtype(dtype).itemsize
    for max_len in (16, 8):  # no per-token entry: the bytes do not grow with length
        assert attnlab.kv_cache_bytes(cfg, 3, max_len) == 3 * per_row
    assert attnlab.kv_cache_bytes(cfg, 3, 16) == sum(a.nbytes for a in cache.layers.values())


@pytest.mark.parametrize(
    "mixer, changes, words",
    [
        ("gated_deltanet", {"chunk_size": 48}, ["mixer_settings.chunk_size=48", "power of two"]),
        ("mamba2", {"chunk_size": 0}, ["mixer_settings.chunk_size=0"]),
        ("mamba2", {"state_dtype": "float16"}, ["mixer_settings.state_dtype", "bfloat16"]),
        ("gated_deltanet", {"state_dtype": "int8"}, ["mixer_settings.state_dtype"]),
        ("gated_deltanet", {"num_k_heads": 3}, ["mixer_settings.num_k_heads", "divisor"]),
        ("gated_deltanet", {"conv_kernel": 1}, ["mixer_settings.conv_kernel"]),
        ("mamba2", {"n_groups": 3}, ["mixer_settings.n_groups", "divisor"]),
        ("mamba2", {"num_heads": 5}, ["mixer_settings.num_heads", "expand * d_model"]),
        ("mamba2", {"form": "fast"}, ["mixer_settings.form", "recurrent"]),
        ("mamba2", {"norm": "after"}, ["mixer_settings.norm='after'", "norm_then_gate"]),
        ("mamba2", {"d_inner": 36}, ["mixer_settings.num_heads", "inner width 36 (d_inner"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(mixer, changes, words):
    base = dict(mixer_checks.TINY, position="none", mixer=mixer)
    mixer_checks.one_line_config_error(words, **base, mixer_settings={**SETTINGS[mixer], **changes})


def test_a_recurrent_layer_refuses_an_encoder_and_packed_documents():
    with pytest.raises(ConfigError, match="arch='encoder'.*use arch='decoder'"):
        tiny("mamba2", arch="encoder")
    model = build_model(tiny("gated_deltanet"), seed=0)
    with pytest.raises(ConfigError, match="segment_ids"):
        model(jnp.array([[3, 4, 5, 6]]), segment_ids_BT=jnp.array([[1, 1, 2, 2]]))
