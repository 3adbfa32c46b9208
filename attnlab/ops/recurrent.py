"""Pieces the recurrent-state layers share (``ops.deltanet``, ``ops.ssd``): the short causal
depthwise convolution with its carried state, the gated RMSNorm on their outputs, L2
normalisation, and the within-chunk decays of the chunked forms.

Padding. A token that is not real (``valid_BT`` False) must leave a layer's state as it
was: its convolution input is zero, and the callers give it decay 1 (log-decay 0) and no
write. Left-padded rows then start from the initial state at their first real token, and a
right-padded prefix ends with the state after its last real token.

Decays are in log space: ``g_BTN <= 0`` multiplies the state by ``exp(g)`` at each token.
Within a chunk, ``gam[i] = g[0] + ... + g[i]``; ``exp(gam[i] - gam[j])`` (``i >= j``) is
the decay from token ``j`` to token ``i``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.precision import upcast

HIGHEST = jax.lax.Precision.HIGHEST


def causal_conv(x_BTZ, w_WZ, bias_Z=None, state_BWZ=None, valid_BT=None):
    """Depthwise causal convolution of ``x`` over time with ``W`` taps, after a carried state.

    ``y[t] = bias + sum_w w[w] * x[t - (W - 1) + w]``, where the ``W - 1`` inputs before the
    first token come from ``state_BWZ`` (``[B, W - 1, Z]``; zeros when None). Returns
    ``(y_BTZ, state_BWZ)``: the output (no activation) and the new state, the last ``W - 1``
    inputs up to each row's last real token (the old state for a row without any).
    """
    B, T, Z = x_BTZ.shape
    W = w_WZ.shape[0]
    x32_BTZ = upcast(x_BTZ)
    if valid_BT is not None:
        x32_BTZ = jnp.where(valid_BT[..., None], x32_BTZ, 0.0)
    if state_BWZ is None:
        state_BWZ = jnp.zeros((B, W - 1, Z), x32_BTZ.dtype)
    xp_BSZ = jnp.concatenate([upcast(state_BWZ), x32_BTZ], axis=1)
    w32_WZ = upcast(w_WZ)
    y_BTZ = sum(xp_BSZ[:, i : i + T] * w32_WZ[i][None, None, :] for i in range(W))
    if bias_Z is not None:
        y_BTZ = y_BTZ + upcast(bias_Z)[None, None, :]
    if valid_BT is None:
        end_B = jnp.full((B,), T, jnp.int32)
    else:  # one past each row's last real token (0: none)
        t_BT = jnp.arange(1, T + 1, dtype=jnp.int32)[None, :]
        end_B = jnp.max(jnp.where(valid_BT, t_BT, 0), axis=1)
    take = lambda xp_SZ, end: jax.lax.dynamic_slice_in_dim(xp_SZ, end, W - 1, axis=0)
    return y_BTZ.astype(x_BTZ.dtype), jax.vmap(take)(xp_BSZ, end_B)


def l2_normalize(x, *, eps=1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in float32 (as FLA and Qwen3-Next)."""
    x32 = upcast(x)
    return x32 * jax.lax.rsqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True) + eps)


def gated_rms_norm(
    x, gate, scale, *, eps=1e-6, group_size=None, norm_before_gate=True, activation=jax.nn.silu
):
    """RMSNorm of ``x`` gated by ``activation(gate)`` (silu; Kimi Linear's is the sigmoid), in
    float32, over groups of ``group_size`` (None: the whole last axis) with a per-channel
    ``scale``.

    ``norm_before_gate``: ``scale * norm(x) * silu(gate)`` (Qwen3-Next), else
    ``scale * norm(x * silu(gate))`` (Mamba-2).
    """
    x32, silu = upcast(x), activation(upcast(gate))
    if not norm_before_gate:
        x32 = x32 * silu
    size = x32.shape[-1] if group_size is None else group_size
    groups = x32.reshape(*x32.shape[:-1], x32.shape[-1] // size, size)
    groups = groups * jax.lax.rsqrt(jnp.mean(jnp.square(groups), -1, keepdims=True) + eps)
    scale = upcast(scale)
    y = groups.reshape(x32.shape) * scale.reshape((1,) * (x32.ndim - 1) + scale.shape)
    if norm_before_gate:
        y = y * silu
    return y.astype(x.dtype)


def chunk_size_for(T: int, chunk_size: int) -> int:
    """The chunk length for ``T`` tokens: ``chunk_size``, or the power of two at or above
    ``T`` when that is shorter (a short prefill need not pad to a whole chunk)."""
    return min(chunk_size, 1 << max(T - 1, 0).bit_length())


def to_chunks(x_BT, C: int):
    """``[B, T, ...]`` zero-padded to a multiple of ``C`` and cut into ``[I, B, C, ...]``."""
    B, T = x_BT.shape[:2]
    pad = -T % C
    x_BT = jnp.pad(x_BT, [(0, 0), (0, pad)] + [(0, 0)] * (x_BT.ndim - 2))
    x = x_BT.reshape(B, (T + pad) // C, C, *x_BT.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def from_chunks(x_IBC, T: int):
    """The inverse of ``to_chunks``: ``[B, T, ...]``."""
    x = jnp.moveaxis(x_IBC, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


def chunk_decays(g_IBNC):
    """``(gam_IBNC, pair_IBNCC)``: the cumulative log-decay within each chunk, and
    ``exp(gam[i] - gam[j])`` for ``i >= j`` (0 above the diagonal)."""
    gam_IBNC = jnp.cumsum(g_IBNC, axis=-1)
    C = g_IBNC.shape[-1]
    lower_CC = jnp.tril(jnp.ones((C, C), bool)).reshape((1,) * (g_IBNC.ndim - 1) + (C, C))
    diff = gam_IBNC[..., :, None] - gam_IBNC[..., None, :]
    pair_IBNCC = jnp.exp(jnp.where(lower_CC, diff, -jnp.inf))
    return gam_IBNC, pair_IBNCC
