"""Float64 NumPy ground truth for the mixture of experts (``attnlab.ops.moe``).

Written from the formulas (Switch Transformer, Mixtral, DeepSeek-V3), never from the code
under test: routing by sorting each token's scores, and the "dense" expert layer that runs
every expert on every token and then keeps the chosen ones.
"""

import numpy as np


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def route(logits, top_k, *, score="softmax", renormalize=True, bias=None, scaling=1.0):
    """``(experts [T, k] best first, weights [T, k])`` by sorting each token's scores."""
    logits = np.asarray(logits, np.float64)
    scores = softmax(logits) if score == "softmax" else 1.0 / (1.0 + np.exp(-logits))
    choice = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    experts = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return experts, weights * scaling


def silu(x):
    return x / (1.0 + np.exp(-x))


def expert_layer_dense(x, experts, weights, w_in, w_out, w_gate=None):
    """Every expert on every token, then the chosen ones weighted and summed: ``[T, D]``.

    ``w_in``/``w_gate`` ``[E, D, F]``, ``w_out`` ``[E, F, D]``; SwiGLU when ``w_gate`` is
    given, else ReLU."""
    x = np.asarray(x, np.float64)
    E = w_in.shape[0]
    h = np.einsum("td,edf->etf", x, np.asarray(w_in, np.float64))
    if w_gate is not None:
        h = silu(np.einsum("td,edf->etf", x, np.asarray(w_gate, np.float64))) * h
    else:
        h = np.maximum(h, 0.0)
    every = np.einsum("etf,efd->etd", h, np.asarray(w_out, np.float64))  # [E, T, D]
    gate = np.zeros((x.shape[0], E))  # the mask: each token's chosen experts, weighted
    for t in range(x.shape[0]):
        for e, w in zip(experts[t], weights[t], strict=True):
            gate[t, e] += w
    return np.einsum("te,etd->td", gate, every)


def expert_layer_clamped_dense(x, experts, weights, w_in, w_gate, w_out, b_in, b_gate, b_out,
                               *, alpha, limit):  # fmt: skip
    """gpt-oss's experts, every one on every token then masked: ``g = min(x W_g + b_g,
    limit)``, ``u = clip(x W_u + b_u, -limit, limit)``, ``(g sigmoid(alpha g) (u + 1)) W_o +
    b_o``."""
    f = lambda a: np.asarray(a, np.float64)
    x = f(x)
    g = np.minimum(np.einsum("td,edf->etf", x, f(w_gate)) + f(b_gate)[:, None], limit)
    u = np.clip(np.einsum("td,edf->etf", x, f(w_in)) + f(b_in)[:, None], -limit, limit)
    h = g / (1.0 + np.exp(-alpha * g)) * (u + 1)
    every = np.einsum("etf,efd->etd", h, f(w_out)) + f(b_out)[:, None]
    gate = np.zeros((x.shape[0], w_in.shape[0]))
    for t in range(x.shape[0]):
        for e, w in zip(experts[t], weights[t], strict=True):
            gate[t, e] += w
    return np.einsum("te,etd->td", gate, every)
