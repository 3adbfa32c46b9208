"""Kimi Delta Attention (``mixer="kda"``, "Kimi Linear", Moonshot AI 2025): the layer against a
float64 loop over the report's equations, in its chunked and recurrent forms; the delta rule
with a decay per key channel in its three forms (chunked, scan, one-token steps) against the
same recurrence; a prefill split anywhere then decoded; a decoder decoding ragged prompts
like its forward pass; finite gradients with masked rows; its cache and its settings' errors.
"""

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import ModelConfig, kv_cache
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.ops import deltanet

SETTINGS = {"num_heads": 2, "head_dim": 4, "gate_rank": 3, "chunk_size": 4}


def tiny(**changes):
    base = dict(mixer_checks.TINY, position="none", mixer="kda", mixer_settings=SETTINGS)
    return ModelConfig(**{**base, **changes})


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def kda_recurrence(q, k, v, g, beta, S0):
    """The report's recurrence per head, token by token in float64 (``S`` is ``[H, J]``)::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t
    """
    B, T, N, H = k.shape
    S, out = np.array(S0, np.float64), np.zeros((B, T, N, v.shape[-1]))
    for b in range(B):
        for n in range(N):
            for t in range(T):
                kt = k[b, t, n][:, None]
                erase = np.eye(H) - beta[b, t, n] * kt @ kt.T
                S[b, n] = erase @ np.diag(np.exp(g[b, t, n])) @ S[b, n]
                S[b, n] += beta[b, t, n] * kt @ v[b, t, n][None, :]
                out[b, t, n] = S[b, n].T @ q[b, t, n]
    return out, S


def kda_float64(x_BTD, layer, eps):
    """The layer from its parameters, every step in float64 NumPy (see ``attnlab.nn.mixers.kda``
    for the equations; the short convolution written out tap by tap)."""
    f = lambda p: np.asarray(p[...], np.float64)
    s = layer.settings
    N, H = s.num_heads, s.head_dim
    B, T, _ = x_BTD.shape
    x = np.asarray(x_BTD, np.float64)
    silu = lambda y: y / (1 + np.exp(-y))
    sigmoid = lambda y: 1 / (1 + np.exp(-y))

    def conv(y_BTZ, w_WZ):  # causal depthwise: y[t] = sum_w w[w] x[t - (W - 1) + w]
        W = w_WZ.shape[0]
        padded = np.concatenate([np.zeros((B, W - 1, y_BTZ.shape[-1])), y_BTZ], axis=1)
        return sum(padded[:, i : i + T] * w_WZ[i] for i in range(W))

    def branch(w_DNH, conv_WZ):
        y = conv(np.einsum("btd,dnh->btnh", x, f(w_DNH)).reshape(B, T, N * H), f(conv_WZ))
        return silu(y).reshape(B, T, N, H)

    unit = lambda y: y / np.sqrt(np.sum(y * y, axis=-1, keepdims=True) + 1e-6)
    q = unit(branch(layer.q_DNH, layer.q_conv_WZ)) / np.sqrt(H)
    k = unit(branch(layer.k_DNH, layer.k_conv_WZ))
    v = branch(layer.v_DNH, layer.v_conv_WZ)
    pre = np.einsum("btr,rnh->btnh", x @ f(layer.f_a_DR), f(layer.f_b_RNH)) + f(layer.dt_bias_NH)
    g = -np.exp(f(layer.A_log_N))[:, None] * np.log1p(np.exp(pre))
    beta = sigmoid(x @ f(layer.beta_DN))
    o, _ = kda_recurrence(q, k, v, g, beta, np.zeros((B, N, H, H)))
    gate = np.einsum("btr,rnh->btnh", x @ f(layer.g_a_DR), f(layer.g_b_RNH))
    o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps) * f(layer.norm_scale_H)
    return np.einsum("btnh,nhd->btd", o * sigmoid(gate), f(layer.o_NHD))


def kda_layer(form, seed=0, **changes):
    cfg = tiny(**changes)
    cls = get_mixer("kda")
    layer = cls(cfg, cls.Settings(**{**SETTINGS, "form": form}), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    for p in (layer.A_log_N, layer.dt_bias_NH, layer.norm_scale_H):  # off their inits
        p[...] += jnp.asarray(0.5 * rng.normal(size=p[...].shape), jnp.float32)
    return cfg, layer


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_the_layer_is_the_reports_recurrence_in_float64(form):
    """Over 11 tokens (chunks of 4: not a whole number of them), both forms equal the float64
    layer to 1e-5 relative."""
    cfg, layer = kda_layer(form)
    x = np.random.default_rng(2).normal(size=(2, 11, cfg.d_model)).astype(np.float32)
    call = MixerCall(positions_BT=jnp.tile(jnp.arange(11), (2, 1)))
    out, cache, _ = jax.jit(lambda x: layer(x, call))(jnp.asarray(x))
    assert cache is None
    assert rel(out, kda_float64(x, layer, cfg.norm_eps)) <= 1e-5


def test_the_per_channel_delta_rule_forms_equal_the_float64_recurrence():
    """From a non-zero state over 19 tokens, a decay per key channel (some strong enough to
    forget a channel within a token): the chunked form (chunks of 4, and of 64: one chunk of
    32 tokens in two sub-chunks of 16), the per-token scan and the one-token step in a loop
    equal the recurrence, outputs and final state."""
    rng = np.random.default_rng(0)
    B, T, N, H, J = 2, 19, 2, 4, 3
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(B, T, N, H))) * H**-0.5
    k, v = unit(rng.normal(size=(B, T, N, H))), rng.normal(size=(B, T, N, J))
    g = -rng.uniform(0, 1.5, (B, T, N, H)) * rng.choice([1.0, 30.0], (B, T, N, H), p=[0.9, 0.1])
    beta, state0 = rng.uniform(0, 1, (B, T, N)), rng.normal(size=(B, N, H, J)) * 0.3
    want_out, want_state = kda_recurrence(q, k, v, g, beta, state0)
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, state0)]

    def steps(*args):
        outs, S = [], args[-1]
        for t in range(T):
            o, S = deltanet.delta_rule_step(*(a[:, t] for a in args[:-1]), S)
            outs.append(o)
        return jnp.stack(outs, 1), S

    forms = {
        "chunked_4": lambda *a: deltanet.delta_rule_chunked(*a, chunk_size=4),
        "chunked_64": lambda *a: deltanet.delta_rule_chunked(*a, chunk_size=64),
        "scan": deltanet.delta_rule_recurrent,
        "step": steps,
    }
    for name, form in forms.items():
        out, state = jax.jit(form)(*args)
        assert out.dtype == jnp.float32 and state.dtype == jnp.float32
        assert rel(out, want_out) <= 1e-5, (name, rel(out, want_out))
        assert rel(state, want_state) <= 1e-5, (name, rel(state, want_state))


def test_a_prefill_split_anywhere_then_decoded_equals_one_plain_pass():
    """The layer through a one-layer cache, one row per split point (0, 3, 5 and 9 of 9
    prompt tokens): a prefill up to the split, a second prefill of the rest (chunks of 4
    crossing the split), then 3 one-token steps; every output equals one plain pass over the
    12 tokens, so a prefill split anywhere equals one prefill, and the steps the forward."""
    cfg, layer = kda_layer("chunked", d_model=16, n_layers=1)
    graphdef, params = nnx.split(layer)
    split_B = jnp.array([0, 3, 5, 9], jnp.int32)
    B, P, T = 4, 9, 12
    x_BTD = jax.random.normal(jax.random.key(5), (B, T, cfg.d_model))

    def view(start_B, count_B, entries):
        cache = attnlab.init_cache(cfg, B, cfg.max_len)
        layers = cache.layers if entries is None else entries
        return kv_cache.LayerCache(layers, jnp.int32(0), start_B, count_B, None, cache.slot_axes)

    @jax.jit
    def run(params):
        layer = nnx.merge(graphdef, params)
        plain, _, _ = layer(x_BTD, MixerCall(jnp.zeros((B, T), jnp.int32)))
        call = lambda c, n: MixerCall(jnp.zeros((B, n), jnp.int32), cache=c)
        first, c, _ = layer(x_BTD[:, :P], call(view(split_B * 0, split_B, None), P))
        rest_BTD = jax.vmap(lambda x, s: jnp.roll(x, -s, axis=0))(x_BTD[:, :P], split_B)
        second, c, _ = layer(rest_BTD, call(view(split_B, P - split_B, c.layers), P))
        second = jax.vmap(lambda x, s: jnp.roll(x, s, axis=0))(second, split_B)
        before = (jnp.arange(P)[None, :] < split_B[:, None])[..., None]
        outs = [jnp.where(before, first, second)]
        for t in range(P, T):
            one_B = jnp.ones((B,), jnp.int32)
            out, c, _ = layer(x_BTD[:, t : t + 1], call(view(one_B * t, one_B, c.layers), 1))
            outs.append(out)
        return plain, jnp.concatenate(outs, axis=1)

    plain, cached = run(params)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(plain), rtol=1e-5, atol=1e-5)


@pytest.mark.slow(reason="compiles a decoder's prefill and steps; the fast tier checks the layer")
def test_a_decoder_decodes_ragged_prompts_like_its_forward_pass():
    """A hybrid of ``kda`` and ``mla`` without positions (Kimi Linear's layers): ragged
    prompts prefilled, then decoded token by token, equal one forward pass."""
    block = {"block": ({"mixer": "kda", "mixer_settings": SETTINGS}, "mla")}
    mixer_checks.prefill_then_steps(tiny(block_pattern=block), atol=1e-5)


@pytest.mark.slow(reason="compiles a decoder's backward pass")
def test_gradients_are_finite_with_masked_rows():
    mixer_checks.grads_finite_with_masked_rows(tiny(n_layers=1))


def test_its_cache_is_a_fixed_size_state_and_conv_entry():
    cfg = tiny()
    entries = get_mixer("kda").cache_entries(cfg, cfg.mixer_settings)
    assert entries["state"].shape == (2, 4, 4) and entries["conv"].shape == (3, 3 * 2 * 4)
    assert entries["state"].slot_axis is None and entries["conv"].slot_axis is None
    per_layer = (2 * 4 * 4 + 3 * 24) * 4  # float32 state and conv, one row
    for max_len in (16, 8):  # nothing grows with the length
        assert attnlab.kv_cache_bytes(cfg, 3, max_len, "bfloat16") == 3 * 2 * per_layer
    # Kimi Linear's 32 heads of 128: a 2 MiB state and 144 KiB of conv inputs per layer.
    kimi = tiny(n_layers=1, mixer_settings={"num_heads": 32, "head_dim": 128})
    assert attnlab.kv_cache_bytes(kimi, 1, 8) == 32 * 128 * 128 * 4 + 3 * 3 * 32 * 128 * 4
    assert attnlab.kv_cache_bytes(kimi, 1, 8) == 2_244_608  # the figure docs/variants.md gives


def test_surgery_fills_k_and_v_from_attentions_key_value_heads():
    """``Mixer.inherit`` from grouped-query attention (2 query heads of 4, 1 key-value head):
    each KDA head takes the key-value head; nothing is filled at another width."""
    cfg, layer = kda_layer("chunked")
    rng = np.random.default_rng(3)
    old = {"q_DNH": rng.normal(size=(32, 2, 4)), "k_DKH": rng.normal(size=(32, 1, 4)),
           "v_DKH": rng.normal(size=(32, 1, 4)), "o_NHD": rng.normal(size=(2, 4, 32))}  # fmt: skip
    new = {"q_DNH": np.asarray(layer.q_DNH[...])}
    got = get_mixer("kda").inherit(cfg, layer.settings, old, new)
    assert set(got) == {"k_DNH", "v_DNH"}
    for n in range(2):
        np.testing.assert_array_equal(got["k_DNH"][:, n], old["k_DKH"][:, 0])
        np.testing.assert_array_equal(got["v_DNH"][:, n], old["v_DKH"][:, 0])
    wide = {**old, "q_DNH": rng.normal(size=(32, 2, 8))}
    assert get_mixer("kda").inherit(cfg, layer.settings, wide, new) == {}


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"num_heads": 0}, ["mixer_settings.num_heads=0", "a positive int"]),
        ({"head_dim": 2.5}, ["mixer_settings.head_dim=2.5", "a positive int"]),
        ({"gate_rank": -1}, ["mixer_settings.gate_rank=-1", "a positive int"]),
        ({"chunk_size": 6}, ["mixer_settings.chunk_size=6", "a power of two"]),
        ({"form": "parallel"}, ["mixer_settings.form='parallel'", "recurrent"]),
        ({"conv_kernel": 1}, ["mixer_settings.conv_kernel=1", "at least 2"]),
        ({"state_dtype": "int8"}, ["mixer_settings.state_dtype='int8'", "bfloat16"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, words):
    mixer_checks.bad_settings("kda", changes, words)
