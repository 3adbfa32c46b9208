"""Lightning attention (``mixer="lightning"``): the layer against a float64 loop over
MiniMax-01's equations (decayed linear attention, output RMSNorm over all heads, sigmoid
gate) at a layer of a deeper stack and without decay; the blockwise form equal to the
recurrence and the one-token steps, padding leaving the state alone; a hybrid decoder
decoding ragged prompts through its cache like its forward pass; finite gradients with
masked rows; its cache and its settings' errors. Against transformers:
``test_pretrained_catalogue`` (``minimax``)."""

import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import reference
from flax import nnx

from attnlab import ModelConfig, kv_cache_bytes
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.errors import ConfigError
from attnlab.ops import lightning


def tiny(**changes):
    return mixer_checks.hybrid(
        {"mixer": "lightning", "mixer_settings": {"block_size": 4}}, **changes
    )


def lightning_float64(x_BTD, layer, layer_index, n_layers, decay=True):
    """Token by token in float64 from the layer's parameters: ``lam_h = exp(-s_h)`` with
    ``s_h = 2^(-8h/N) (1 - l/(L-1) + 1e-5)`` (MiniMax-01), ``S = lam S + v k^T``,
    ``o = S q``, then ``(RMSNorm(o) * sigmoid(x W_g)) W_o``."""
    f = lambda p: np.asarray(p[...], np.float64)
    x = np.asarray(x_BTD, np.float64)
    qkv_DNH = f(layer.qkv_DNH)
    D, N, H3 = qkv_DNH.shape
    H = H3 // 3
    qkv = reference.silu(np.einsum("btd,dnh->btnh", x, qkv_DNH))
    q, k, v = qkv[..., :H], qkv[..., H : 2 * H], qkv[..., 2 * H :]
    h = np.arange(1, N + 1)
    slope = 2.0 ** (-8.0 * h / N) * (1 - layer_index / (n_layers - 1 + 1e-5) + 1e-5)
    lam = np.exp(-slope) if decay else np.ones(N)
    Bsz, T = x.shape[:2]
    o = np.zeros((Bsz, T, N, H))
    for b in range(Bsz):
        S = np.zeros((N, H, H))  # [value, key]
        for t in range(T):
            S = lam[:, None, None] * S + v[b, t][:, :, None] * k[b, t][:, None, :]
            o[b, t] = np.einsum("njh,nh->nj", S, q[b, t])
    o = o.reshape(Bsz, T, N * H)
    o = reference.rms_norm(o, f(layer.norm_scale_NH).reshape(-1), eps=layer.settings.norm_eps)
    gate = 1 / (1 + np.exp(-np.einsum("btd,dnh->btnh", x, f(layer.gate_DNH))))
    return np.einsum("btnh,nhd->btd", o.reshape(Bsz, T, N, H) * gate, f(layer.out_NHD))


@pytest.mark.parametrize(
    "decay, layer_index, form",
    [(True, 1, "chunked"), (True, 3, "chunked"), (False, 1, "chunked"), (True, 2, "recurrent")],
)
def test_the_layer_is_minimax_lightning_attention_in_float64(decay, layer_index, form):
    cfg = ModelConfig(**{**mixer_checks.TINY, "n_layers": 4}, mixer="lightning")
    cls = get_mixer("lightning")
    layer = cls(cfg, cls.Settings(block_size=4, decay=decay, form=form), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    layer.norm_scale_NH[...] = jnp.asarray(1 + 0.3 * rng.normal(size=(4, 8)), jnp.float32)
    x = rng.normal(size=(2, 7, cfg.d_model)).astype(np.float32)  # 2 blocks, the last partial
    call = MixerCall(positions_BT=jnp.tile(jnp.arange(7), (2, 1)), layer=jnp.int32(layer_index))
    out, cache, weights = layer(jnp.asarray(x), call)
    want = lightning_float64(x, layer, layer_index, 4, decay)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert cache is None and weights is None


def test_the_slopes_are_minimax_s_schedule():
    # MiniMax-01 with 64 heads over 80 layers: head 1 of the first layer decays at 2^(-1/8),
    # head 64 at 2^-8 (times 1 + 1e-5); the last layer's rates are ~2e-5 of the first's.
    s_first = np.asarray(lightning.slopes(64, 0, 80))
    want = np.array([2 ** (-1 / 8), 2**-8]) * (1 + 1e-5)
    np.testing.assert_allclose(s_first[[0, 63]], want, rtol=1e-6)
    s_last = np.asarray(lightning.slopes(64, 79, 80))
    np.testing.assert_allclose(s_last / s_first, 1 - 79 / (79 + 1e-5) + 1e-5, rtol=1e-3)


def test_the_blocks_equal_the_recurrence_and_the_steps_and_padding_keeps_the_state():
    rng = np.random.default_rng(2)
    B, T, N, H = 2, 7, 3, 4
    q, k, v = (jnp.asarray(np.abs(rng.normal(size=(B, T, N, H))), jnp.float32) for _ in "qkv")
    slope = jnp.asarray([0.5, 0.1, 0.01], jnp.float32)
    S0 = jnp.asarray(rng.normal(size=(B, N, H, H)), jnp.float32)
    valid = np.ones((B, T), bool)
    valid[1, 4] = False  # a token that is not real: the state passes it unchanged
    valid = jnp.asarray(valid)
    o_rec, S_rec = lightning.lightning_recurrent(q, k, v, slope, S0, valid)
    o_blk, S_blk = lightning.lightning_blocks(q, k, v, slope, S0, valid, block_size=4)
    np.testing.assert_allclose(np.asarray(o_blk), np.asarray(o_rec), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(S_blk), np.asarray(S_rec), rtol=1e-5, atol=1e-5)
    S = S0
    for t in range(T):
        o_t, S_next = lightning.lightning_step(q[:, t], k[:, t], v[:, t], slope, S, valid[:, t])
        np.testing.assert_allclose(np.asarray(o_t), np.asarray(o_rec[:, t]), rtol=1e-5, atol=1e-5)
        if t == 4:
            np.testing.assert_array_equal(np.asarray(S_next[1]), np.asarray(S[1]))
        S = S_next
    np.testing.assert_allclose(np.asarray(S), np.asarray(S_rec), rtol=1e-5, atol=1e-5)


@pytest.mark.slow(reason="compiles a decoder's prefill and steps; the fast tier checks the layer")
def test_a_decoder_with_it_decodes_ragged_prompts_like_its_forward_pass():
    """Ragged prefills (3 and 6 tokens) then steps equal one forward pass, so a prefill split
    at any point and continued equals one prefill (blocks of 4 cross the split; the
    recurrence equals the blocks in the fast tier)."""
    mixer_checks.prefill_then_steps(tiny(position="rope"), atol=1e-5)


@pytest.mark.slow(reason="compiles a decoder's backward pass")
def test_gradients_are_finite_with_masked_rows():
    mixer_checks.grads_finite_with_masked_rows(tiny(position="rope"))


def test_its_cache_is_one_fixed_size_state():
    entries = mixer_checks.hybrid_cache_entries(tiny(), "lightning")
    assert set(entries) == {"state"} and entries["state"].shape == (4, 8, 8)
    assert entries["state"].slot_axis is None
    assert kv_cache_bytes(tiny(), 1, 8, "float32") == 8 * 2 * 32 * 4 + 4 * 8 * 8 * 4


def test_surgery_from_softmax_attention_keeps_its_q_k_v_and_output():
    """``init="matching"``: head n's q is attention's head n, its k and v those of its
    key-value head (n // G); the output projection is attention's."""
    cfg = ModelConfig(**{**mixer_checks.TINY, "n_kv_heads": 2}, mixer="lightning")
    rng = np.random.default_rng(4)
    D, N, K, H = 32, 4, 2, 8
    old = {"q_DNH": rng.normal(size=(D, N, H)), "k_DKH": rng.normal(size=(D, K, H)),
           "v_DKH": rng.normal(size=(D, K, H)), "o_NHD": rng.normal(size=(N, H, D))}  # fmt: skip
    cls = get_mixer("lightning")
    got = cls.inherit(cfg, cls.Settings(), old, {})
    assert set(got) == {"qkv_DNH", "out_NHD"}
    for n in range(N):
        np.testing.assert_array_equal(got["qkv_DNH"][:, n, :H], old["q_DNH"][:, n])
        np.testing.assert_array_equal(got["qkv_DNH"][:, n, H : 2 * H], old["k_DKH"][:, n // 2])
        np.testing.assert_array_equal(got["qkv_DNH"][:, n, 2 * H :], old["v_DKH"][:, n // 2])
    np.testing.assert_array_equal(got["out_NHD"], old["o_NHD"])
    assert cls.inherit(cfg, cls.Settings(), {"q_DNH": old["q_DNH"]}, {}) == {}


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"block_size": 6}, ["mixer_settings.block_size=6", "a power of two"]),
        ({"block_size": 0}, ["mixer_settings.block_size=0", "a positive int"]),
        ({"decay": "yes"}, ["mixer_settings.decay='yes'", "True or False"]),
        ({"norm_eps": 0.0}, ["mixer_settings.norm_eps=0.0", "a positive float"]),
        ({"state_dtype": "int8"}, ["mixer_settings.state_dtype='int8'", "bfloat16"]),
        ({"form": "parallel"}, ["mixer_settings.form='parallel'", "recurrent"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, words):
    mixer_checks.bad_settings("lightning", changes, words)


def test_an_encoder_is_refused_naming_the_architecture():
    with pytest.raises(ConfigError, match="arch='decoder'"):
        ModelConfig(**mixer_checks.TINY, arch="encoder", mixer="lightning")
