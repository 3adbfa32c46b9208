"""Two per-layer settings of the 2025 families: NoPE layers (``layer_pattern`` entries with
``rope=False``: SmolLM3) and the xIELU activation (``ffn="xielu"``: Apertus), against
independent references, and their bad settings as one-line errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import ops
from attnlab.config import ModelConfig
from attnlab.errors import ConfigError
from attnlab.nn.models import build_model


def xielu_float64(x, alpha_p, alpha_n, beta=0.5, eps=-1e-6):
    """Huang and Schlag (2024), eq. (6) with a_p = softplus(alpha_p), a_n = beta +
    softplus(alpha_n): a_p x^2 + beta x for x > 0, a_n (expm1(min(x, eps)) - x) + beta x."""
    softplus = lambda v: math.log1p(math.exp(v))
    a_p, a_n = softplus(alpha_p), beta + softplus(alpha_n)
    out = []
    for v in np.asarray(x, np.float64).ravel():
        out.append(
            a_p * v * v + beta * v if v > 0 else a_n * (math.expm1(min(v, eps)) - v) + beta * v
        )
    return np.asarray(out).reshape(np.shape(x))


def test_xielu_matches_its_float64_formula_and_has_finite_gradients():
    x = np.concatenate([np.linspace(-8, 8, 101), [-1e-7, 0.0, 1e-7]]).astype(np.float32)
    got = np.asarray(ops.activations.xielu(jnp.asarray(x), 0.3, -0.7))
    np.testing.assert_allclose(got, xielu_float64(x, 0.3, -0.7), rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda a, b: ops.activations.xielu(jnp.asarray(x), a, b).sum(), (0, 1))
    assert all(np.isfinite(float(g)) for g in grads(0.3, -0.7))


_TINY = dict(
    arch="decoder", vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_len=16,
    position="rope", norm="rmsnorm", tie_embeddings=False, init_std=0.5,
)  # fmt: skip


@pytest.mark.slow(reason="builds and compiles three tiny models (about 2 s)")
def test_layers_without_rope_compute_as_a_model_without_positions():
    nope = ModelConfig(**_TINY, layer_pattern=[{"rope": False}])
    plain = ModelConfig(**{**_TINY, "position": "none"})
    a, b = build_model(nope, seed=0), build_model(plain, seed=1)
    nnx.update(b, nnx.state(a, nnx.Param))
    ids = np.random.default_rng(0).integers(0, 32, (2, 9)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(a(ids).logits), np.asarray(b(ids).logits), atol=1e-5)
    rotating = ModelConfig(**_TINY, layer_pattern=[{"rope": True}, {"rope": False}])
    c = build_model(rotating, seed=0)
    assert np.abs(np.asarray(c(ids).logits) - np.asarray(a(ids).logits)).max() > 1e-3


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(layer_pattern=[{"rope": "no"}]), r"layer_pattern=.*rope must be True or False"),
        (dict(position="learned", layer_pattern=[{"rope": False}]), r"set position='rope'"),
        (dict(layer_pattern=[{"rotary": False}]), r"unknown key\(s\) \['rotary'\]"),
        (dict(ffn="xielu", ffn_variant="moe"), r"ModelConfig.ffn='xielu' is invalid: .*dense"),
    ],
)
def test_bad_settings_are_one_line(fields, match):
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig(**{**_TINY, **fields})
    assert "\n" not in str(e.value)
