"""Mamba-1's selective state space layer (``mixer="mamba"``): the layer against a float64
loop over the paper's recurrence (Gu and Dao 2023, Algorithm 2), with and without Jamba's
inner norms; the chunked and recurrent scans equal; a hybrid decoder decoding ragged prompts
through its cache like its forward pass; finite gradients with masked rows; its cache and
its settings' errors."""

import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import reference
from flax import nnx

from attnlab import ModelConfig
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.ops import selective_scan


def tiny(**changes):
    return mixer_checks.hybrid({"mixer": "mamba", "mixer_settings": {"chunk_size": 4}}, **changes)


def softplus(x):
    return np.log1p(np.exp(x))


def mamba_float64(x_BTD, layer, eps):
    """Algorithm 2 of the paper, token by token in float64, from the layer's parameters."""
    f = lambda p: None if p is None else np.asarray(p[...], np.float64)
    s = layer.settings
    R, J = s.dt_rank, s.state_size
    xz = np.asarray(x_BTD, np.float64) @ f(layer.in_proj_DZ)
    x, z = np.split(xz, 2, axis=-1)
    x = reference.silu(reference.causal_depthwise_conv(x, f(layer.conv_WZ), f(layer.conv_bias_Z)))
    p = x @ f(layer.x_proj_ZR)
    dt, Bm, Cm = p[..., :R], p[..., R : R + J], p[..., R + J :]
    if s.inner_norms:
        dt = reference.rms_norm(dt, f(layer.dt_norm_R), eps=eps)
        Bm = reference.rms_norm(Bm, f(layer.b_norm_J), eps=eps)
        Cm = reference.rms_norm(Cm, f(layer.c_norm_J), eps=eps)
    dt = softplus(dt @ f(layer.dt_proj_RZ) + f(layer.dt_bias_Z))
    A = -np.exp(f(layer.A_log_ZJ))
    Bsz, T, Z = x.shape
    y = np.zeros((Bsz, T, Z))
    for b in range(Bsz):
        h = np.zeros((Z, J))
        for t in range(T):
            h = np.exp(dt[b, t][:, None] * A) * h + (dt[b, t] * x[b, t])[:, None] * Bm[b, t][None]
            y[b, t] = h @ Cm[b, t]
    y = (y + f(layer.D_Z) * x) * reference.silu(z)
    return y @ f(layer.out_proj_ZD)


@pytest.mark.parametrize(
    "inner_norms", [False, pytest.param(True, marks=pytest.mark.slow(reason="one more layer"))]
)
def test_the_layer_is_the_papers_recurrence_in_float64(inner_norms):
    cfg = ModelConfig(**mixer_checks.TINY, mixer="mamba")
    cls = get_mixer("mamba")
    settings = cls.Settings(state_size=4, chunk_size=4, inner_norms=inner_norms)
    layer = cls(cfg, settings, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    layer.A_log_ZJ[...] += jnp.asarray(rng.normal(size=layer.A_log_ZJ[...].shape), jnp.float32)
    if inner_norms:
        for p in (layer.dt_norm_R, layer.b_norm_J, layer.c_norm_J):
            p[...] = jnp.asarray(1 + 0.3 * rng.normal(size=p[...].shape), jnp.float32)
    x = rng.normal(size=(2, 9, cfg.d_model)).astype(np.float32)
    call = MixerCall(positions_BT=jnp.tile(jnp.arange(9), (2, 1)))
    out, cache, _ = layer(jnp.asarray(x), call)
    want = mamba_float64(x, layer, cfg.norm_eps)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert cache is None


def test_the_chunked_scan_equals_the_recurrent_one_and_the_steps():
    rng = np.random.default_rng(2)
    B, T, Z, J = 2, 11, 6, 3
    x, Bm, Cm = (
        jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(B, T, Z), (B, T, J), (B, T, J)]
    )
    dt = jnp.asarray(softplus(rng.normal(size=(B, T, Z))), jnp.float32)
    dt = dt.at[1, 4].set(0.0)  # a token that is not real: the state passes it unchanged
    A = -jnp.asarray(np.exp(rng.normal(size=(Z, J))), jnp.float32)
    h0 = jnp.asarray(rng.normal(size=(B, Z, J)), jnp.float32)
    y_rec, h_rec = selective_scan.selective_scan_recurrent(x, dt, A, Bm, Cm, h0)
    y_chk, h_chk = selective_scan.selective_scan_chunked(x, dt, A, Bm, Cm, h0, chunk_size=4)
    np.testing.assert_allclose(np.asarray(y_chk), np.asarray(y_rec), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(h_chk), np.asarray(h_rec), rtol=1e-5, atol=1e-5)
    h = h0
    for t in range(T):
        y_t, h = selective_scan.selective_scan_step(x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], h)
        np.testing.assert_allclose(np.asarray(y_t), np.asarray(y_rec[:, t]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow(reason="compiles a decoder's prefill and steps; the fast tier checks the layer")
def test_a_decoder_with_it_decodes_ragged_prompts_like_its_forward_pass():
    """Ragged prefills (3 and 6 tokens) then steps equal one forward pass, so a prefill split
    at any point and continued equals one prefill (chunks of 4 cross the split; the recurrent
    scan equals the chunked one in the fast tier)."""
    mixer_checks.prefill_then_steps(tiny(position="rope"), atol=1e-5)


@pytest.mark.slow(reason="compiles a decoder's backward pass")
def test_gradients_are_finite_with_masked_rows():
    mixer_checks.grads_finite_with_masked_rows(tiny(position="rope"))


def test_its_cache_is_a_fixed_size_state_and_conv_entry():
    cfg = tiny()
    entries = mixer_checks.hybrid_cache_entries(cfg, "mamba")
    Z = 2 * cfg.d_model
    assert entries["state"].shape == (Z, 16) and entries["conv"].shape == (3, Z)
    assert entries["state"].slot_axis is None and entries["conv"].slot_axis is None


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"state_size": 0}, ["mixer_settings.state_size=0", "a positive int"]),
        ({"dt_rank": -1}, ["mixer_settings.dt_rank=-1", "a positive int"]),
        ({"inner_norms": 1}, ["mixer_settings.inner_norms=1", "True or False"]),
        ({"chunk_size": 6}, ["mixer_settings.chunk_size=6", "a power of two"]),
        ({"form": "parallel"}, ["mixer_settings.form='parallel'", "recurrent"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, words):
    mixer_checks.bad_settings("mamba", changes, words)
