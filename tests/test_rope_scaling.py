"""RoPE scaling (``ModelConfig.rope_scaling``, ``ops.rope_frequencies``) against transformers'
own ``ROPE_INIT_FUNCTIONS`` on the same settings: the inverse frequencies (rtol 1e-6) and the
factor on the rotated dims, for linear, Llama 3.1's llama3, YaRN (gpt-oss's untruncated
ramp, DeepSeek's mscale pair, an explicit attention factor) and Phi-3's LongRoPE (short and
long factors, partial rotary). Bad settings are one line naming ``rope_scaling.<field>``.
"""

import numpy as np
import pytest

from attnlab.config import ModelConfig
from attnlab.errors import ConfigError
from attnlab.ops import RopeScaling, apply_rope, rope_frequencies
from attnlab.pretrained.hf_base import rope_scaling_of

H = 16
_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# name -> (transformers rope_parameters, config class, extra config kwargs)
CASES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, "LlamaConfig", {}),
    "llama3": (
        {"rope_type": "llama3", **_LLAMA3, "original_max_position_embeddings": 64},
        "LlamaConfig",
        {},
    ),
    "yarn_gpt_oss": (
        {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 4096},
        "LlamaConfig",
        {"max_position_embeddings": 131072},
    ),
    "yarn_deepseek": (
        {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0,
         "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096},
        "LlamaConfig",
        {"max_position_embeddings": 163840},
    ),
    "yarn_attention_factor": (
        {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3, "beta_fast": 16,
         "original_max_position_embeddings": 32},
        "LlamaConfig",
        {"max_position_embeddings": 128},
    ),
    "longrope": (
        {"rope_type": "longrope", "partial_rotary_factor": 0.5,
         "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.5, 2.0, 3.0, 9.0]},
        "Phi3Config",
        {"max_position_embeddings": 4096, "original_max_position_embeddings": 256},
    ),
}  # fmt: skip


def _hf(name):
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    pytest.importorskip("torch", reason="transformers computes RoPE with torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, config_cls, extra = CASES[name]
    params = {**params, "rope_theta": 10000.0}
    config = getattr(transformers, config_cls)(
        hidden_size=64, num_attention_heads=4, head_dim=H, rope_parameters=dict(params), **extra
    )
    fn = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    short = fn(config)
    long = fn(config, seq_len=extra.get("original_max_position_embeddings", 0) + 1)
    return config, short, long


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_match_transformers(name):
    config, (inv, factor), (inv_long, _) = _hf(name)
    c = {**config.to_dict(), "model_type": "llama"}
    scaling = ModelConfig(
        vocab_size=8, d_model=64, n_heads=4, head_dim=H, position="rope",
        rotary_dim=int(H * c["rope_parameters"].get("partial_rotary_factor", 1.0)),
        rope_scaling=rope_scaling_of(c),
    ).rope_scaling  # fmt: skip
    assert scaling.kind == CASES[name][0]["rope_type"]
    dim = 2 * inv.shape[0]
    ours, ours_factor = rope_frequencies(dim, 10000.0, scaling)
    np.testing.assert_allclose(np.asarray(ours), inv.numpy(), rtol=1e-6)
    assert ours_factor == pytest.approx(factor, rel=1e-9)
    if scaling.kind == "longrope":
        ours_long, _ = rope_frequencies(dim, 10000.0, scaling, long=True)
        np.testing.assert_allclose(np.asarray(ours_long), inv_long.numpy(), rtol=1e-6)
        assert not np.allclose(np.asarray(ours_long), np.asarray(ours))
    else:  # the scaling changes the frequencies or the factor
        plain, _ = rope_frequencies(dim, 10000.0)
        assert not np.allclose(np.asarray(ours), np.asarray(plain)) or ours_factor != 1.0


def test_apply_rope_rotates_by_the_scaled_frequencies_times_the_factor():
    """A float64 rotation by given frequencies, times YaRN's factor, equals ``apply_rope``."""
    scaling = RopeScaling(kind="yarn", factor=8.0, original_max_len=16)
    inv, factor = rope_frequencies(H, 500.0, scaling)
    assert factor == pytest.approx(0.1 * np.log(8.0) + 1)
    x = np.random.default_rng(0).normal(size=(1, 5, 2, H))
    pos = np.arange(5)[None] * 7
    angles = pos[..., None, None] * np.asarray(inv, np.float64)
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    c, s = np.cos(angles) * factor, np.sin(angles) * factor
    expected = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    out = apply_rope(x.astype(np.float32), pos, theta=500.0, scaling=scaling)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5)


def test_longrope_switches_to_long_factors_past_the_original_context():
    scaling = RopeScaling(
        kind="longrope", factor=4.0, original_max_len=8,
        short_factor=(1.0,) * 4, long_factor=(4.0,) * 4,
    )  # fmt: skip
    x = np.ones((1, 1, 1, 8), np.float32)
    factor = np.sqrt(1 + np.log(4.0) / np.log(8))
    within = apply_rope(x, np.array([[7]]), scaling=scaling)
    beyond = apply_rope(x, np.array([[8]]), scaling=scaling)
    short = apply_rope(x, np.array([[7]])) * factor
    long = apply_rope(x, np.array([[2]])) * factor  # 8 / 4: every frequency divided by 4
    np.testing.assert_allclose(np.asarray(within), np.asarray(short), atol=1e-6)
    np.testing.assert_allclose(np.asarray(beyond), np.asarray(long), atol=1e-6)


@pytest.mark.parametrize(
    "scaling, field",
    [
        ({"kind": "ntk"}, "rope_scaling.kind"),
        ({"kind": "linear", "factor": 0}, "rope_scaling.factor"),
        ({"kind": "yarn", "factor": 4.0}, "rope_scaling.original_max_len"),
        ({"kind": "linear", "factor": 2.0, "beta_fast": 4.0}, "rope_scaling.beta_fast"),
        ({"kind": "longrope", "original_max_len": 8, "short_factor": [1.0] * 8,
          "long_factor": [1.0] * 3}, "rope_scaling.long_factor"),
        ({"kind": "linear", "factor": 2.0, "scale": 1}, "rope_scaling"),
    ],
)  # fmt: skip
def test_bad_scaling_is_one_line_naming_the_field(scaling, field):
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}=") as err:
        ModelConfig(vocab_size=8, d_model=32, n_heads=2, position="rope", rope_scaling=scaling)
    assert "\n" not in str(err.value)


def test_scaling_survives_to_dict_and_needs_rope():
    cfg = ModelConfig(
        vocab_size=8, d_model=32, n_heads=2, position="rope",
        rope_scaling={"kind": "longrope", "original_max_len": 8, "factor": 2.0,
                      "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    )  # fmt: skip
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="ModelConfig.rope_scaling="):
        cfg.replace(position="learned")


def test_config_json_scaling_is_read_from_either_layout_and_unknown_kinds_are_refused():
    from attnlab.pretrained.configs import model_config_from_hf
    from attnlab.pretrained.hf_base import UnsupportedCheckpointError

    qwen2 = dict(
        model_type="qwen2", vocab_size=32, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=131072,
    )  # fmt: skip
    # The older top-level layout (Qwen2.5's long-context recipe): factor and original length.
    old = dict(qwen2, rope_theta=1e6, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})  # fmt: skip
    s = model_config_from_hf(old).rope_scaling
    assert (s.kind, s.factor, s.original_max_len, s.truncate) == ("yarn", 4.0, 32768, True)
    # transformers v5's rope_parameters; a yarn without factor takes max / original length.
    new = dict(qwen2, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6,
                                       "original_max_position_embeddings": 32768})  # fmt: skip
    assert model_config_from_hf(new).rope_scaling.factor == 4.0
    assert model_config_from_hf(dict(qwen2, rope_theta=1e6)).rope_scaling is None
    dynamic = dict(qwen2, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedCheckpointError, match=r"rope_scaling\.rope_type='dynamic'"):
        model_config_from_hf(dynamic)
