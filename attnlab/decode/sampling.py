"""Choosing the next token from logits: greedy, temperature, top-k, top-p and min-p.

Conventions: ``logits_BV`` are float32 (float64 for a float64 model: filters compute in
``attnlab.ops.precision.wide`` of the logits), one row per sequence. A filter keeps the logits of
the tokens it allows and sets the others to ``-inf``; filters compose in a fixed order,
each acting on the distribution the previous one left:

1. ``logits / temperature`` (``temperature == 0`` is greedy: argmax, no randomness);
2. top-k: the ``k`` highest logits (``k == 0``: off);
3. top-p (nucleus): the smallest set of most probable tokens whose mass is ``>= p``
   (``p == 1``: off); tokens tied with the last one kept are kept as well;
4. min-p: tokens whose probability is ``>= min_p * `` the top probability (``0``: off).

Every setting may be a traced scalar: a jitted loop takes ``SamplingConfig`` as a pytree
argument, so new values never recompile. Off-values given as Python numbers skip their
filter at trace time; traced ones select at run time.

Randomness comes only from the key passed in; generation derives step ``i``'s key as
``jax.random.fold_in(key, i)``, so the same seed gives the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from attnlab.errors import DecodeError
from attnlab.ops.precision import upcast, wide


def _concrete(x) -> bool:
    return isinstance(x, int | float | np.number) and not isinstance(x, bool)


@struct.dataclass
class SamplingConfig:
    """How to pick a token; a pytree, so jitted loops trace its values."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        if isinstance(t, bool) or (_concrete(t) and not t >= 0):
            raise DecodeError(f"temperature={t!r} must be >= 0 (0 = greedy)")
        if isinstance(k, bool | float) or (_concrete(k) and k < 0):
            raise DecodeError(f"top_k={k!r} must be an integer >= 0 (0 = off)")
        if _concrete(p) and not 0.0 < p <= 1.0:
            raise DecodeError(f"top_p={p!r} must lie in (0, 1] (1 = off)")
        if _concrete(m) and not 0.0 <= m <= 1.0:
            raise DecodeError(f"min_p={m!r} must lie in [0, 1] (0 = off)")

    @property
    def greedy(self) -> bool:
        """Whether the temperature is 0 (only for concrete values)."""
        return self.temperature == 0.0

    def traced(self, dtype=np.float32) -> SamplingConfig:
        """The same settings as fixed-dtype NumPy scalars: one compiled program for all.
        ``dtype``: that of the floating settings, the logits' (``wide``: float64 for a
        float64 model, whose temperature would otherwise be rounded to float32)."""
        real = np.dtype(dtype).type
        return SamplingConfig(
            real(self.temperature),
            np.int32(self.top_k),
            real(self.top_p),
            real(self.min_p),
        )


def _keep(logits_BV, keep_BV):
    return jnp.where(keep_BV, logits_BV, -jnp.inf)


def top_k_filter(logits_BV, k):
    """Keeps exactly the ``k`` highest logits of each row (lowest index wins ties)."""
    V = logits_BV.shape[-1]
    if _concrete(k) and (k <= 0 or k >= V):
        return logits_BV
    order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
    rank_BV = jnp.put_along_axis(
        jnp.zeros(logits_BV.shape, jnp.int32),
        order_BV,
        jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), logits_BV.shape),
        axis=-1,
        inplace=False,
    )
    return _keep(logits_BV, (k <= 0) | (rank_BV < k))


def top_p_filter(logits_BV, p):
    """Keeps the smallest set of most probable tokens whose probability mass is ``>= p``."""
    if _concrete(p) and p >= 1.0:
        return logits_BV
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass strictly above each token
    n_keep_B1 = jnp.sum(before_BV < p, axis=-1, keepdims=True)  # >= 1: the top is kept
    threshold_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)
    return _keep(logits_BV, (p >= 1.0) | (logits_BV >= threshold_B1))


def min_p_filter(logits_BV, min_p):
    """Keeps tokens with probability ``>= min_p`` times the row's top probability."""
    if _concrete(min_p) and min_p <= 0.0:
        return logits_BV
    top_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    log_min_p = jnp.log(jnp.maximum(min_p, jnp.finfo(wide(logits_BV)).tiny))
    return _keep(logits_BV, (min_p <= 0.0) | (logits_BV >= top_B1 + log_min_p))


def filter_logits(logits_BV, sampling: SamplingConfig):
    """Temperature-scaled logits with the tokens the filters reject set to ``-inf``, in
    ``wide(logits_BV)`` (float32, float64 for float64 logits)."""
    logits_BV = upcast(logits_BV)
    t = sampling.temperature
    if not (_concrete(t) and t == 0.0):
        logits_BV = logits_BV / jnp.where(t > 0, t, 1.0).astype(logits_BV.dtype)
    logits_BV = top_k_filter(logits_BV, sampling.top_k)
    logits_BV = top_p_filter(logits_BV, sampling.top_p)
    return min_p_filter(logits_BV, sampling.min_p)


def argmax(logits_BV):
    """``jnp.argmax`` over the last axis as ``[B]`` int32 (the first maximum; the first NaN
    where there is one), as a max and a min: XLA:CPU runs ``argmax``'s paired (value,
    index) reduction about 3x slower over a 50,257-token vocabulary."""
    V = logits_BV.shape[-1]
    top_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    index_BV = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, logits_BV.ndim - 1)
    hit_BV = (logits_BV == top_B1) | jnp.isnan(logits_BV)
    return jnp.min(jnp.where(hit_BV, index_BV, V), axis=-1)


def sample(logits_BV, key, sampling: SamplingConfig):
    """One token id per row, ``[B]`` int32; exactly the argmax when the temperature is 0."""
    greedy_fn = lambda: argmax(logits_BV)
    if _concrete(sampling.temperature) and sampling.temperature == 0.0:
        return greedy_fn()

    def draw():
        filtered_BV = filter_logits(logits_BV, sampling)
        return jax.random.categorical(key, filtered_BV, axis=-1).astype(jnp.int32)

    if _concrete(sampling.temperature):
        return draw()
    return jax.lax.cond(sampling.temperature > 0, draw, greedy_fn)
