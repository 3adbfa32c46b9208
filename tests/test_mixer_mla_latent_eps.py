"""``mla``'s ``latent_norm_eps``: the eps of the q and kv latents' RMSNorms, apart from the
model's ``norm_eps`` (Kimi Linear's latents use 1e-6 beside layer norms of 1e-5). With small
latents, where the eps shows, the layer equals the float64 reference at its own eps and not
at the model's; a bad value is a one-line error naming the field."""

import numpy as np
import pytest
import reference
from test_mixer_differential_mla import MLA, MLA_SETTINGS, close, inputs, layer_mixer, mla_params

from attnlab import ModelConfig
from attnlab.contracts.mixer import MixerCall
from attnlab.errors import ConfigError
from attnlab.ops import MaskSpec


def test_the_latent_norms_use_their_own_eps():
    settings = {**MLA_SETTINGS, "latent_norm_eps": 1e-6}
    cfg = ModelConfig(**{**MLA, "mixer_settings": settings, "norm_eps": 1e-3})
    attn, params = layer_mixer(cfg)
    for name in ("q_down_DR", "kv_down_DR"):  # latents of RMS ~ 1e-2
        params[name][...] = params[name][...] * 1e-2
    x_BTD, positions_BT = inputs(cfg)
    call = MixerCall(positions_BT=positions_BT, mask=MaskSpec.for_sequence(6, causal=True))
    out_BTD, _, _ = attn(x_BTD, call)
    causal = np.tril(np.ones((6, 6), bool))
    want = lambda eps: reference.latent_attention(
        x_BTD, mla_params(params), mask=causal, positions_BT=positions_BT,
        theta=cfg.rope_theta, eps=eps,
    )[0]  # fmt: skip
    close(out_BTD, want(1e-6))
    assert np.abs(np.asarray(out_BTD) - want(cfg.norm_eps)).max() > 1e-2


@pytest.mark.parametrize("value", [0.0, -1e-6, "1e-6", True])
def test_a_bad_latent_eps_is_a_one_line_error_naming_the_field(value):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{**MLA, "mixer_settings": {**MLA_SETTINGS, "latent_norm_eps": value}})
    assert "\n" not in str(info.value)
    assert "mixer_settings.latent_norm_eps" in str(info.value) and "positive" in str(info.value)
