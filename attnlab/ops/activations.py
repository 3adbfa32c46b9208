"""Feed-forward activations, plain and gated.

Gated units (GLU family) take the gate and the linear branch separately:
``swiglu(gate, up) = silu(gate) * up``, ``geglu(gate, up) = gelu(gate) * up``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def relu(x):
    return jax.nn.relu(x)


def gelu(x):
    """Exact GELU, x * Phi(x) (erf form), as in BERT."""
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x):
    """tanh approximation of GELU, as in GPT-2 ("gelu_new")."""
    return jax.nn.gelu(x, approximate=True)


def silu(x):
    return jax.nn.silu(x)


def swiglu(gate, up):
    return jax.nn.silu(gate) * up


def geglu(gate, up):
    return gelu(gate) * up


def geglu_tanh(gate, up):
    """Gated GELU with the tanh approximation (T5 v1.1 "gated-gelu")."""
    return gelu_tanh(gate) * up


ACTIVATIONS = {"relu": relu, "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu}
GATED = {"swiglu": jax.nn.silu, "geglu": gelu, "geglu_tanh": gelu_tanh}
FFN_KINDS = tuple(ACTIVATIONS) + tuple(GATED)


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
    x_BTD, w_in_DF, w_out_FD, *, kind="gelu", w_gate_DF=None, b_in_F=None, b_out_D=None
):
    """A position-wise FFN: out = act(x W_in + b_in) W_out + b_out, or the gated form."""
    act = activation(kind)
    h_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, w_in_DF)
    if b_in_F is not None:
        h_BTF = h_BTF + b_in_F[None, None, :]
    if is_gated(kind):
        if w_gate_DF is None:
            raise ValueError(f"FFN kind {kind!r} is gated and needs w_gate_DF")
        h_BTF = act(jnp.einsum("BTD,DF->BTF", x_BTD, w_gate_DF)) * h_BTF
    else:
        h_BTF = act(h_BTF)
    out_BTD = jnp.einsum("BTF,FD->BTD", h_BTF, w_out_FD)
    return out_BTD if b_out_D is None else out_BTD + b_out_D[None, None, :]
