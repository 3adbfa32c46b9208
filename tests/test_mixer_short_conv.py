"""LFM2's gated short convolution (``mixer="short_conv"``): the layer against its float64
formula, a hybrid decoder of it and attention decoding ragged prompts through the cache like
its forward pass (prefills split anywhere), finite gradients with masked rows, its one cache
entry and its settings' errors. Left padding: LFM2's logits in ``test_pretrained_catalogue``."""

import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import reference
from flax import nnx

from attnlab import ModelConfig
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.errors import ConfigError


def tiny(**changes):
    return mixer_checks.hybrid("short_conv", **changes)


def short_conv_float64(x, layer):
    """``(c * conv1d(b * h)) W_out`` with ``b, c, h = x W_b + b_b, x W_c + b_c, x W_h + b_h``."""
    f = lambda p: None if p is None else np.asarray(p[...], np.float64)
    x = np.asarray(x, np.float64)
    b = x @ f(layer.b_proj_DZ) + f(layer.b_bias_Z)
    c = x @ f(layer.c_proj_DZ) + f(layer.c_bias_Z)
    h = x @ f(layer.h_proj_DZ) + f(layer.h_bias_Z)
    conv = reference.causal_depthwise_conv(b * h, f(layer.conv_WZ), f(layer.conv_bias_Z))
    return (c * conv) @ f(layer.out_ZD) + f(layer.out_bias_D)


def test_the_layer_is_the_doubly_gated_convolution_of_its_formula():
    cfg = ModelConfig(**mixer_checks.TINY, mixer="short_conv")
    cls = get_mixer("short_conv")
    layer = cls(cfg, cls.Settings(bias=True), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for b in (layer.b_bias_Z, layer.c_bias_Z, layer.h_bias_Z, layer.conv_bias_Z, layer.out_bias_D):
        b[...] = jnp.asarray(rng.normal(size=b[...].shape), jnp.float32)  # zero at init
    x = rng.normal(size=(2, 7, cfg.d_model)).astype(np.float32)
    call = MixerCall(positions_BT=jnp.tile(jnp.arange(7), (2, 1)))  # no padding: no mask
    out, cache, weights = layer(jnp.asarray(x), call)
    want = short_conv_float64(x, layer)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert cache is None and weights is None


@pytest.mark.slow(reason="compiles a decoder's prefill and steps; the fast tier checks the layer")
def test_a_decoder_with_it_decodes_ragged_prompts_like_its_forward_pass():
    """Ragged prefills (3 and 6 tokens) then token-by-token steps equal one forward pass, so
    a prefill split at any point and continued equals one prefill."""
    mixer_checks.prefill_then_steps(tiny(position="rope"), atol=1e-5, steps=4)


@pytest.mark.slow(reason="compiles a decoder's backward pass")
def test_gradients_are_finite_with_masked_rows():
    mixer_checks.grads_finite_with_masked_rows(tiny(position="rope"))


def test_its_cache_is_one_fixed_size_conv_entry():
    cfg = tiny()
    entries = mixer_checks.hybrid_cache_entries(cfg, "short_conv")
    assert set(entries) == {"conv"} and entries["conv"].shape == (2, cfg.d_model)
    assert entries["conv"].slot_axis is None


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"conv_kernel": 1}, ["mixer_settings.conv_kernel=1", "at least 2"]),
        ({"bias": "yes"}, ["mixer_settings.bias='yes'", "True or False"]),
        ({"state_dtype": "int8"}, ["mixer_settings.state_dtype", "bfloat16"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, words):
    mixer_checks.bad_settings("short_conv", changes, words)
    with pytest.raises(ConfigError, match="arch='encoder'.*use arch='decoder'"):
        ModelConfig(**mixer_checks.TINY, mixer="short_conv", arch="encoder")
