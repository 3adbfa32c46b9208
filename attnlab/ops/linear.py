"""Projections, biases and dropout: the pure pieces every layer is made of."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def dense(x, w, *, n_in=1, out_dtype=None):
    """Contracts the last ``n_in`` axes of ``x`` with the first ``n_in`` of ``w``.

    Tokens are flattened so the product is one 2-D GEMM going forward and both ways back:
    XLA:CPU runs a weight gradient contracting over (B, T) far slower than one over B*T.
    """
    k = math.prod(x.shape[x.ndim - n_in :])
    y = jnp.dot(
        x.reshape(-1, k), w.reshape(k, -1).astype(x.dtype), preferred_element_type=out_dtype
    )
    return y.reshape(x.shape[: x.ndim - n_in] + w.shape[n_in:])


def add_bias(x, b):
    """``x + b`` with ``b`` broadcast over x's leading axes (explicit rank)."""
    b = b.astype(x.dtype)
    return x + b.reshape((1,) * (x.ndim - b.ndim) + b.shape)


def dropout(x, rate: float, key):
    """Inverted dropout; the identity when ``key`` is None (evaluation) or ``rate`` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def fold(key, *data):
    """``fold_in`` along a path of integers; None stays None (deterministic)."""
    if key is None:
        return None
    for d in data:
        key = jax.random.fold_in(key, d)
    return key
