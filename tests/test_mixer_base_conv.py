"""The gated short convolution (``mixer="base_conv"``, Zoology's BaseConv): the layer against
its float64 formula, a decoder of it and attention decoding ragged prompts through the cache
like its forward pass, its one cache entry and its settings' errors."""

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
    return mixer_checks.hybrid("base_conv", **changes)


def test_the_layer_is_the_gated_convolution_of_its_formula():
    """``conv1d(x) * (x P + b)`` with a 3-tap depthwise filter and its bias (float64)."""
    cfg = ModelConfig(**mixer_checks.TINY, mixer="base_conv")
    cls = get_mixer("base_conv")
    layer = cls(cfg, cls.Settings(), rngs=nnx.Rngs(0))
    layer.proj_bias_Z[...] = jnp.linspace(-1, 1, cfg.d_model)  # zero at init: make it count
    x = np.random.default_rng(0).normal(size=(2, 7, cfg.d_model)).astype(np.float32)
    call = MixerCall(positions_BT=jnp.tile(jnp.arange(7), (2, 1)))  # no padding: no mask
    out, cache, weights = layer(jnp.asarray(x), call)
    conv = reference.causal_depthwise_conv(x, layer.conv_WZ[...], layer.conv_bias_Z[...])
    gate = np.asarray(x, np.float64) @ np.asarray(layer.proj_DZ[...], np.float64)
    want = conv * (gate + np.asarray(layer.proj_bias_Z[...], np.float64))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    assert cache is None and weights is None


@pytest.mark.slow(reason="compiles a decoder's prefill and steps; the fast tier checks the layer")
def test_a_decoder_with_it_decodes_ragged_prompts_like_its_forward_pass():
    """Prefill (3 and 6 tokens) then token-by-token steps equal one forward pass: the cache
    carries the convolution's last inputs across calls."""
    mixer_checks.prefill_then_steps(tiny(position="rope"), atol=1e-5)


def test_its_cache_is_one_fixed_size_conv_entry():
    cfg = tiny(mixer_settings=None)
    entries = mixer_checks.hybrid_cache_entries(cfg, "base_conv")
    assert set(entries) == {"conv"} and entries["conv"].shape == (2, cfg.d_model)
    assert entries["conv"].slot_axis is None


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"conv_kernel": 1}, ["mixer_settings.conv_kernel=1", "at least 2"]),
        ({"state_dtype": "int8"}, ["mixer_settings.state_dtype", "bfloat16"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, words):
    mixer_checks.bad_settings("base_conv", changes, words)
    with pytest.raises(ConfigError, match="arch='encoder'.*use arch='decoder'"):
        ModelConfig(**mixer_checks.TINY, mixer="base_conv", arch="encoder")
