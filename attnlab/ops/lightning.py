"""Lightning attention (Lightning Attention-2, Qin et al. 2024; MiniMax-01, 2025): causal
linear attention with a fixed exponential decay per head, in three forms: a one-token step,
the per-token recurrence (the reference) and the blockwise form (training and prefill).

Per head, with ``lam = exp(-slope)`` and the state ``S`` a ``[J, H]`` matrix (value width
J = key width H)::

    S_t = lam S_{t-1} + v_t k_t^T,   o_t = S_t q_t

The blockwise form splits the tokens into blocks: inside a block the decayed, causal
``(Q K^T * Lam) V`` (intra-block), plus the queries against the state carried from the
previous blocks, decayed to each position (inter-block); the state is then decayed over the
block and the block's decayed ``K^T V`` added. That is ``attnlab.ops.ssd``'s chunked form
with ``x = v``, ``B = k``, ``C = q``, a unit step and ``A = -slope``, so the forms here are
those, with the step ``dt`` 1 for a real token and 0 for one that is not (padding leaves the
state as it was). The state is at least float32 throughout; each form returns ``(o_BTNH,
state_BNJH)``.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnlab.ops import ssd
from attnlab.ops.precision import wide


def slopes(n_heads: int, layer, n_layers: int, dtype=jnp.float32):
    """``[N]`` decay rates (in ``dtype``) of layer ``layer`` (0-based, may be traced) of
    ``n_layers``, as MiniMax-01 sets them: ALiBi's geometric rates ``2^(-8 h / N)`` for heads
    ``h = 1..N``, times ``1 - layer / (n_layers - 1) + 1e-5`` (the deeper, the slower)."""
    base = 2.0 ** (-8.0 / n_heads)
    rate_N = base ** jnp.arange(1, n_heads + 1, dtype=dtype)
    depth = jnp.asarray(layer, dtype) / (n_layers - 1 + 1e-5)
    return rate_N * (1.0 - depth + 1e-5)


def _steps(q_BTNH, valid_BT):
    """``[B, T, N]`` unit steps, 0 where a token is not real."""
    B, T, N, _ = q_BTNH.shape
    dt_BTN = jnp.ones((B, T, N), wide(q_BTNH))
    return dt_BTN if valid_BT is None else jnp.where(valid_BT[..., None], dt_BTN, 0.0)


def lightning_step(q_BNH, k_BNH, v_BNJ, slope_N, state_BNJH, valid_B=None):
    """One token: ``(o_BNJ, state_BNJH)``; a token that is not real (``valid_B`` False)
    leaves the state as it was."""
    dt_BN = jnp.ones(q_BNH.shape[:2], wide(q_BNH))
    if valid_B is not None:
        dt_BN = jnp.where(valid_B[:, None], dt_BN, 0.0)
    return ssd.ssd_step(v_BNJ, dt_BN, -slope_N, k_BNH, q_BNH, state_BNJH)


def lightning_recurrent(q_BTNH, k_BTNH, v_BTNJ, slope_N, state_BNJH=None, valid_BT=None):
    """The per-token recurrence (the reference form): ``(o_BTNJ, state_BNJH)``."""
    dt_BTN = _steps(q_BTNH, valid_BT)
    return ssd.ssd_recurrent(v_BTNJ, dt_BTN, -slope_N, k_BTNH, q_BTNH, state_BNJH)


def lightning_blocks(
    q_BTNH, k_BTNH, v_BTNJ, slope_N, state_BNJH=None, valid_BT=None, *, block_size: int = 256
):
    """The blockwise form (intra-block plus inter-block): ``(o_BTNJ, state_BNJH)``, equal
    to the recurrence."""
    dt_BTN = _steps(q_BTNH, valid_BT)
    return ssd.ssd_chunked(
        v_BTNJ, dt_BTN, -slope_N, k_BTNH, q_BTNH, state_BNJH, chunk_size=block_size
    )
