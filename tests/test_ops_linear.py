"""``ops.dense`` with a wider output: values and gradients against float64 NumPy, and the
backward products kept in the operands' dtype."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.ops import dense

BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((2, 3, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((16, 24)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((2, 3, 24)), jnp.float32)
    return x, w, r


def _loss(x, w, r):
    return jnp.sum(dense(x, w, out_dtype=jnp.float32) * r)


def test_wide_output_matches_float64():
    x, w, r = _inputs()
    x64, w64, r64 = (np.asarray(a, np.float64) for a in (x, w, r))
    y = dense(x, w, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32
    # The operands are exact in float64; only the float32 accumulation differs.
    np.testing.assert_allclose(np.asarray(y), x64 @ w64, rtol=1e-5, atol=1e-5)
    dx, dw = jax.grad(_loss, argnums=(0, 1))(x, w, r)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx, np.float64), r64 @ w64.T, **BF16_TOL)
    np.testing.assert_allclose(
        np.asarray(dw, np.float64), np.einsum("btk,btn->kn", x64, r64), **BF16_TOL
    )


def _dot_operand_types(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    return re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)


def test_backward_products_stay_in_the_operands_dtype():
    """Plain autodiff of a float32-output product upcasts the weight for the backward
    products (float32 GEMMs); dense keeps all three in bfloat16."""
    x, w, r = _inputs(1)
    grads = jax.value_and_grad(_loss, argnums=(0, 1))
    dots = _dot_operand_types(grads, x, w, r)
    assert len(dots) == 3, dots  # forward, and one per operand backward
    assert all("bf16" in a and "bf16" in b for a, b in dots), dots

    def plain(x, w, r):
        y = jnp.dot(x.reshape(-1, 16), w, preferred_element_type=jnp.float32)
        return jnp.sum(y.reshape(2, 3, 24) * r)

    plain_dots = _dot_operand_types(jax.value_and_grad(plain, argnums=(0, 1)), x, w, r)
    assert any("f32" in a or "f32" in b for a, b in plain_dots), plain_dots


def test_same_dtype_output_is_a_plain_product():
    x, w, _ = _inputs(2)
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(dense(x32, w32, out_dtype=jnp.float32)), np.asarray(dense(x32, w32))
    )
