"""The dtype computations run in: at least float32, or the inputs' own dtype when it is
wider (float64 under JAX's 64-bit mode). Statistics, softmaxes, rotary tables, router
scores and accumulations go through ``wide``; no float32 is forced on a float64 model."""

from __future__ import annotations

import jax.numpy as jnp


def wide(*xs) -> jnp.dtype:
    """The widest of float32 and the dtypes of ``xs`` (arrays or dtypes)."""
    out = jnp.dtype(jnp.float32)
    for x in xs:
        dtype = jnp.dtype(getattr(x, "dtype", x))
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > out.itemsize:
            out = dtype
    return out


def upcast(x):
    """``x`` in ``wide(x)``: bfloat16 and float16 to float32, float32 and float64 kept."""
    return x.astype(wide(x))
