"""Normalisation layers as pure functions; statistics are computed in at least float32
(``precision.wide``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.precision import upcast


def _expand(p, y):
    """A [D] parameter in y's dtype with y's rank (explicit broadcasting)."""
    p = jnp.asarray(p, y.dtype)
    return p.reshape((1,) * (y.ndim - p.ndim) + p.shape)


def layer_norm(x, scale=None, bias=None, *, eps=1e-5):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis."""
    x32 = upcast(x)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * _expand(scale, y)
    if bias is not None:
        y = y + _expand(bias, y)
    return y.astype(x.dtype)


def rms_norm(x, scale=None, *, eps=1e-6):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis."""
    x32 = upcast(x)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    if scale is not None:
        y = y * _expand(scale, y)
    return y.astype(x.dtype)
