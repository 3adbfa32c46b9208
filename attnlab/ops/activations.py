"""Feed-forward activations, plain and gated.

Gated units (GLU family) take the gate and the linear branch separately:
``swiglu(gate, up) = silu(gate) * up``, ``geglu(gate, up) = gelu(gate) * up``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from attnlab.ops.linear import add_bias, dense, dropout
from attnlab.ops.precision import upcast


def relu(x):
    """``max(x, 0)``."""
    return jax.nn.relu(x)


def relu2(x):
    """Squared ReLU ``max(x, 0)^2`` (Primer; Nemotron-H's MLP)."""
    return jnp.square(jax.nn.relu(x))


def _with_saved_derivative(value_and_derivative):
    """An activation whose backward pass reuses the derivative computed going forward.

    Autodiff of erf/tanh/sigmoid activations re-evaluates the transcendental in the
    backward pass, and XLA:CPU may fuse that recomputation into the neighbouring matmul,
    repeating it once per output element. Saving ``f'(x)`` (one array the size of ``x``)
    makes the backward pass a single multiply.
    """

    @jax.custom_vjp
    def f(x):
        return value_and_derivative(x)[0]

    def fwd(x):
        y, dy = value_and_derivative(x)
        return y, dy

    def bwd(dy, g):
        return (g * dy,)

    f.defvjp(fwd, bwd)
    return f


def _gelu_and_derivative(x):
    x32 = upcast(x)
    cdf = 0.5 * (1.0 + jax.lax.erf(x32 * (1.0 / math.sqrt(2.0))))
    pdf = jnp.exp(-0.5 * x32 * x32) * (1.0 / math.sqrt(2.0 * math.pi))
    return (x32 * cdf).astype(x.dtype), (cdf + x32 * pdf).astype(x.dtype)


def _gelu_tanh_and_derivative(x):
    x32 = upcast(x)
    c = math.sqrt(2.0 / math.pi)
    t = jnp.tanh(c * (x32 + 0.044715 * x32**3))
    dt = (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x32 * x32)
    return (0.5 * x32 * (1.0 + t)).astype(x.dtype), (0.5 * (1.0 + t) + 0.5 * x32 * dt).astype(
        x.dtype
    )


def _silu_and_derivative(x):
    x32 = upcast(x)
    s = jax.nn.sigmoid(x32)
    return (x32 * s).astype(x.dtype), (s * (1.0 + x32 * (1.0 - s))).astype(x.dtype)


gelu = _with_saved_derivative(_gelu_and_derivative)
gelu.__doc__ = "Exact GELU, x * Phi(x) (erf form), as in BERT."
gelu_tanh = _with_saved_derivative(_gelu_tanh_and_derivative)
gelu_tanh.__doc__ = 'tanh approximation of GELU, as in GPT-2 ("gelu_new").'
silu = _with_saved_derivative(_silu_and_derivative)
silu.__doc__ = "x * sigmoid(x) (swish)."


def swiglu(gate, up):
    """The SwiGLU product ``silu(gate) * up``."""
    return silu(gate) * up


def clamped_swiglu(gate, up, *, alpha=1.702, limit=7.0):
    """gpt-oss's gated unit: ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate,
    limit)`` and ``u = clip(up, -limit, limit)``; computed in at least float32."""
    g = jnp.minimum(upcast(gate), limit)
    u = jnp.clip(upcast(up), -limit, limit)
    return (g * jax.nn.sigmoid(alpha * g) * (u + 1)).astype(gate.dtype)


def geglu(gate, up):
    """The GeGLU product ``gelu(gate) * up`` (exact GELU)."""
    return gelu(gate) * up


def geglu_tanh(gate, up):
    """Gated GELU with the tanh approximation (T5 v1.1 "gated-gelu")."""
    return gelu_tanh(gate) * up


def xielu(x, alpha_p, alpha_n, *, beta=0.5, eps=-1e-6):
    """xIELU (Huang and Schlag 2024, Apertus): ``a_p x^2 + beta x`` for ``x > 0``, else
    ``a_n (expm1(min(x, eps)) - x) + beta x``, with ``a_p = softplus(alpha_p)`` and ``a_n =
    beta + softplus(alpha_n)`` from the learned scalars; computed in at least float32."""
    x32 = upcast(x)
    a_p = jax.nn.softplus(jnp.asarray(alpha_p, x32.dtype))
    a_n = beta + jax.nn.softplus(jnp.asarray(alpha_n, x32.dtype))
    negative = a_n * (jnp.expm1(jnp.minimum(x32, eps)) - x32)
    return (jnp.where(x32 > 0, a_p * x32 * x32, negative) + beta * x32).astype(x.dtype)


def _inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


ACTIVATIONS = {
    "relu": relu,
    "relu2": relu2,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": silu,
    "xielu": xielu,
}
GATED = {"swiglu": silu, "geglu": gelu, "geglu_tanh": gelu_tanh}
FFN_KINDS = tuple(ACTIVATIONS) + tuple(GATED)
# Activations with learned scalars, one of each per FFN: name -> initial value (xIELU's
# a_p = 0.8 and a_n = 0.8, before the softplus). The FFN holds them as ``act_<name>`` and
# passes them by name.
PARAMETERS = {"xielu": {"alpha_p": _inverse_softplus(0.8), "alpha_n": _inverse_softplus(0.3)}}


def is_gated(kind):
    return kind in GATED


def activation(kind):
    """The elementwise function of an FFN kind (the gate's function for gated kinds)."""
    if kind in ACTIVATIONS:
        return ACTIVATIONS[kind]
    if kind in GATED:
        return GATED[kind]
    raise ValueError(f"unknown FFN kind {kind!r}; use one of {FFN_KINDS}")


def feed_forward(
    x_BTD,
    w_in_DF,
    w_out_FD,
    *,
    kind="gelu",
    w_gate_DF=None,
    b_in_F=None,
    b_out_D=None,
    dropout_rate: float = 0.0,
    key=None,
    hidden_fn=None,
    act_params: dict | None = None,
):
    """A position-wise FFN: ``act(x W_in + b_in) W_out + b_out``, or the gated form
    ``act(x W_gate) * (x W_in + b_in)``; dropout (with ``key``) on the hidden units.
    ``hidden_fn``: a map of the hidden units ``[..., F]`` (after the activation) before the
    output projection, e.g. to read or replace them; None: none. ``act_params``: the learned
    scalars of an activation that has them (``PARAMETERS``)."""
    act = activation(kind)
    if kind in PARAMETERS:
        if set(act_params or {}) != set(PARAMETERS[kind]):
            raise ValueError(f"FFN kind {kind!r} needs act_params {sorted(PARAMETERS[kind])}")
        act = functools.partial(act, **act_params)
    h_BTF = dense(x_BTD, w_in_DF)
    if b_in_F is not None:
        h_BTF = add_bias(h_BTF, b_in_F)
    if is_gated(kind):
        if w_gate_DF is None:
            raise ValueError(f"FFN kind {kind!r} is gated and needs w_gate_DF")
        h_BTF = act(dense(x_BTD, w_gate_DF)) * h_BTF
    else:
        h_BTF = act(h_BTF)
    if hidden_fn is not None:
        h_BTF = hidden_fn(h_BTF)
    out_BTD = dense(dropout(h_BTF, dropout_rate, key), w_out_FD)
    return out_BTD if b_out_D is None else add_bias(out_BTD, b_out_D)
