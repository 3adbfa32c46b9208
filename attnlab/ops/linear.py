"""Projections, biases and dropout: the pure pieces every layer is made of."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Transposed:
    """A weight stored with its output axes first: ``t`` is ``w`` with its first ``n_in``
    (input) axes moved to the end. ``dense`` contracts it as it would ``w``; at batch 1
    XLA:CPU's matrix-vector products stream a weight stored this way faster
    (``benchmarks/matvec.py``), at batch 8 slower. ``shape`` is ``w``'s."""

    t: jax.Array
    n_in: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def of(cls, w, n_in=1):
        """``w`` (input axes first, as ``dense`` takes it) stored output axes first."""
        return cls(jnp.moveaxis(w, tuple(range(n_in)), tuple(range(-n_in, 0))), n_in)

    @property
    def shape(self):
        """The weight's shape in its own layout (input axes first)."""
        n_out = self.t.ndim - self.n_in
        return self.t.shape[n_out:] + self.t.shape[:n_out]

    @property
    def dtype(self):
        """The stored array's dtype."""
        return self.t.dtype

    def astype(self, dtype):
        """The same weight cast to ``dtype``."""
        return Transposed(self.t.astype(dtype), self.n_in)

    def __getitem__(self, index):  # ``param[...]`` reads the weight whole
        if index is not Ellipsis:
            raise TypeError("a Transposed weight is read whole, with [...]")
        return self

    def original(self):
        """The weight in its own layout (a copy)."""
        n_out = self.t.ndim - self.n_in
        return jnp.moveaxis(self.t, tuple(range(n_out, self.t.ndim)), tuple(range(self.n_in)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _wide_dot(x_MK, w_KN, out_dtype):
    """``x @ w`` accumulated and returned in the wider ``out_dtype``; its gradients are
    products in the operands' own dtype (accumulated in float32). Plain autodiff would
    carry the wide cotangent into both backward products, upcasting the weight: float32
    GEMMs, for a bfloat16 model's output head the largest products of the step."""
    return jnp.dot(x_MK, w_KN, preferred_element_type=out_dtype)


def _wide_dot_fwd(x_MK, w_KN, out_dtype):
    return _wide_dot(x_MK, w_KN, out_dtype), (x_MK, w_KN)


def _wide_dot_bwd(out_dtype, res, g_MN):
    x_MK, w_KN = res
    g_MN = g_MN.astype(x_MK.dtype)
    f32 = jnp.float32
    dx_MK = jnp.dot(g_MN, w_KN.T, preferred_element_type=f32).astype(x_MK.dtype)
    dw_KN = jnp.dot(x_MK.T, g_MN, preferred_element_type=f32).astype(w_KN.dtype)
    return dx_MK, dw_KN


_wide_dot.defvjp(_wide_dot_fwd, _wide_dot_bwd)


def dense(x, w, *, n_in=1, out_dtype=None):
    """Contracts the last ``n_in`` axes of ``x`` with the first ``n_in`` of ``w`` (also a
    ``Transposed`` weight), in ``x``'s dtype; ``out_dtype`` (e.g. float32 logits of a
    bfloat16 model) accumulates and returns the product wider, while the backward products
    stay in ``x``'s dtype. Such a widened product is differentiated in reverse mode only
    (``jax.grad``, ``jax.vjp``); ``jax.jvp`` through it is refused.

    Tokens are flattened so the product is one 2-D GEMM going forward and both ways back:
    XLA:CPU runs a weight gradient contracting over (B, T) far slower than one over B*T.
    """
    k = math.prod(x.shape[x.ndim - n_in :])
    if isinstance(w, Transposed):
        t = w.t.reshape(-1, k).astype(x.dtype)
        y = jnp.einsum("mk,nk->mn", x.reshape(-1, k), t, preferred_element_type=out_dtype)
        return y.reshape(x.shape[: x.ndim - n_in] + w.shape[n_in:])
    x_MK, w_KN = x.reshape(-1, k), w.reshape(k, -1).astype(x.dtype)
    if out_dtype is not None and jnp.dtype(out_dtype) != x.dtype:
        y = _wide_dot(x_MK, w_KN, jnp.dtype(out_dtype))
    else:
        y = jnp.dot(x_MK, w_KN, preferred_element_type=out_dtype)
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
