"""``attnlab.ops`` norms, activations and feed-forward against the float64 references."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from attnlab.ops import (
    FFN_KINDS,
    feed_forward,
    geglu,
    geglu_tanh,
    gelu,
    gelu_tanh,
    layer_norm,
    relu,
    rms_norm,
    silu,
    swiglu,
)
from attnlab.ops.activations import PARAMETERS

B, T, D, F = 2, 3, 16, 24
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _rand(seed, shape, *, scale=1.0, dtype=jnp.float32):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), dtype)


# --------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm(affine):
    x = _rand(0, (B, T, D), scale=3.0) + 2.0
    scale, bias = (_rand(1, (D,)), _rand(2, (D,))) if affine else (None, None)
    got = layer_norm(x, scale, bias)
    assert got.shape == x.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref.layer_norm(x, scale, bias), **TOL)
    if not affine:
        np.testing.assert_allclose(np.asarray(got).mean(-1), 0.0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got).std(-1), 1.0, atol=1e-4)


def test_layer_norm_scale_only_and_eps():
    x = _rand(3, (B, T, D), scale=1e-2)
    scale = _rand(4, (D,))
    got = layer_norm(x, scale, eps=1e-3)
    np.testing.assert_allclose(np.asarray(got), ref.layer_norm(x, scale, eps=1e-3), **TOL)


@pytest.mark.parametrize("affine", [False, True])
def test_rms_norm(affine):
    x = _rand(5, (B, T, D), scale=3.0) + 1.0
    scale = _rand(6, (D,)) if affine else None
    got = rms_norm(x, scale)
    assert got.shape == x.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref.rms_norm(x, scale), **TOL)
    if not affine:
        np.testing.assert_allclose(np.sqrt(np.mean(np.asarray(got) ** 2, -1)), 1.0, atol=1e-5)
    got = rms_norm(x, scale, eps=0.5)
    np.testing.assert_allclose(np.asarray(got), ref.rms_norm(x, scale, eps=0.5), **TOL)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norms_in_bfloat16_compute_statistics_in_float32(norm):
    # A large common offset would swamp a bfloat16 mean; float32 statistics keep it.
    x = _rand(7, (B, T, D), dtype=jnp.bfloat16) + jnp.asarray(50.0, jnp.bfloat16)
    scale = _rand(8, (D,))
    if norm == "layer":
        got, want = layer_norm(x, scale), ref.layer_norm(x.astype(jnp.float32), scale)
    else:
        got, want = rms_norm(x, scale), ref.rms_norm(x.astype(jnp.float32), scale)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------

X = jnp.asarray(np.linspace(-6.0, 6.0, 97), jnp.float32)


@pytest.mark.parametrize(
    ("fn", "want_fn"),
    [(relu, ref.relu), (gelu, ref.gelu), (gelu_tanh, ref.gelu_tanh), (silu, ref.silu)],
    ids=["relu", "gelu", "gelu_tanh", "silu"],
)
def test_activation_matches_reference(fn, want_fn):
    got = fn(X)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want_fn(X), rtol=1e-5, atol=1e-6)


def test_activation_values_by_hand():
    x = jnp.asarray([1.0, -1.0], jnp.float32)
    phi1 = 0.5 * (1.0 + math.erf(1.0 / math.sqrt(2.0)))
    np.testing.assert_allclose(np.asarray(gelu(x)), [phi1, -(1.0 - phi1)], rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(silu(x)), [1 / (1 + math.exp(-1)), -1 / (1 + math.exp(1))], rtol=1e-6
    )
    # The tanh form is an approximation: close to exact GELU, but not equal to it.
    exact, approx = ref.gelu(X), np.asarray(gelu_tanh(X), np.float64)
    assert 1e-5 < np.abs(exact - approx).max() < 1e-3


@pytest.mark.parametrize(
    ("fn", "gate_fn"),
    [(swiglu, ref.silu), (geglu, ref.gelu), (geglu_tanh, ref.gelu_tanh)],
    ids=["swiglu", "geglu", "geglu_tanh"],
)
def test_gated_units(fn, gate_fn):
    gate, up = _rand(9, (B, T, F)), _rand(10, (B, T, F))
    np.testing.assert_allclose(np.asarray(fn(gate, up)), gate_fn(gate) * np.asarray(up), **TOL)


# --------------------------------------------------------------------------------------------
# Feed-forward
# --------------------------------------------------------------------------------------------


def _ffn_params(seed):
    return {
        "w_in_DF": _rand(seed, (D, F), scale=D**-0.5),
        "w_out_FD": _rand(seed + 1, (F, D), scale=F**-0.5),
        "w_gate_DF": _rand(seed + 2, (D, F), scale=D**-0.5),
        "b_in_F": _rand(seed + 3, (F,), scale=0.1),
        "b_out_D": _rand(seed + 4, (D,), scale=0.1),
    }


@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("kind", [k for k in FFN_KINDS if k not in PARAMETERS])
def test_feed_forward_matches_reference(kind, biases):
    """Activations without learned scalars (xIELU's: tests/test_nope_xielu.py)."""
    x = _rand(11, (B, T, D))
    p = _ffn_params(12)
    gated = kind in ref.GATED
    kwargs = {"w_gate_DF": p["w_gate_DF"] if gated else None}
    if biases:
        kwargs.update(b_in_F=p["b_in_F"], b_out_D=p["b_out_D"])
    got = feed_forward(x, p["w_in_DF"], p["w_out_FD"], kind=kind, **kwargs)
    assert got.shape == (B, T, D) and got.dtype == jnp.float32
    want = ref.feed_forward(x, p["w_in_DF"], p["w_out_FD"], kind=kind, **kwargs)
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_feed_forward_default_kind_is_exact_gelu():
    x, p = _rand(13, (B, T, D)), _ffn_params(14)
    got = feed_forward(x, p["w_in_DF"], p["w_out_FD"])
    want = ref.feed_forward(x, p["w_in_DF"], p["w_out_FD"], kind="gelu")
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_feed_forward_errors():
    x, p = _rand(15, (B, T, D)), _ffn_params(16)
    with pytest.raises(ValueError, match="'swiglu' is gated and needs w_gate_DF"):
        feed_forward(x, p["w_in_DF"], p["w_out_FD"], kind="swiglu")
    with pytest.raises(ValueError, match="unknown FFN kind 'tanh'"):
        feed_forward(x, p["w_in_DF"], p["w_out_FD"], kind="tanh")
