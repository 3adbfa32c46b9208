"""Choosing the next token from logits: greedy, temperature, top-k, top-p and min-p.

Conventions: ``logits_BV`` are float32, one row per sequence. A filter keeps the logits of
the tokens it allows and sets the others to ``-inf``; filters compose in a fixed order,
each acting on the distribution the previous one left:

1. ``logits / temperature`` (``temperature == 0`` is greedy: argmax, no randomness);
2. top-k: the ``k`` highest logits (``k == 0``: off);
3. top-p (nucleus): the smallest set of most probable tokens whose mass is ``>= p``
   (``p == 1``: off); tokens tied with the last one kept are kept as well;
4. min-p: tokens whose probability is ``>= min_p * `` the top probability (``0``: off).

Randomness comes only from the key passed in; generation derives step ``i``'s key as
``jax.random.fold_in(key, i)``, so the same seed gives the same tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick a token; hashable, so jitted loops take it as a static argument."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must lie in (0, 1] (1 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} must lie in [0, 1] (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _keep(logits_BV, keep_BV):
    return jnp.where(keep_BV, logits_BV, -jnp.inf)


def top_k_filter(logits_BV, k: int):
    """Keeps exactly the ``k`` highest logits of each row (lowest index wins ties)."""
    V = logits_BV.shape[-1]
    if k <= 0 or k >= V:
        return logits_BV
    _, idx_BK = jax.lax.top_k(logits_BV, k)
    keep_BV = jnp.put_along_axis(
        jnp.zeros(logits_BV.shape, bool), idx_BK, True, axis=-1, inplace=False
    )
    return _keep(logits_BV, keep_BV)


def top_p_filter(logits_BV, p: float):
    """Keeps the smallest set of most probable tokens whose probability mass is ``>= p``."""
    if p >= 1.0:
        return logits_BV
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass strictly above each token
    n_keep_B1 = jnp.sum(before_BV < p, axis=-1, keepdims=True)  # >= 1: the top is kept
    threshold_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)
    return _keep(logits_BV, logits_BV >= threshold_B1)


def min_p_filter(logits_BV, min_p: float):
    """Keeps tokens with probability ``>= min_p`` times the row's top probability."""
    if min_p <= 0.0:
        return logits_BV
    top_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    return _keep(logits_BV, logits_BV >= top_B1 + math.log(min_p))


def filter_logits(logits_BV, sampling: SamplingConfig):
    """Temperature-scaled logits with the tokens the filters reject set to ``-inf``."""
    logits_BV = logits_BV.astype(jnp.float32)
    if not sampling.greedy:
        logits_BV = logits_BV / sampling.temperature
    logits_BV = top_k_filter(logits_BV, sampling.top_k)
    logits_BV = top_p_filter(logits_BV, sampling.top_p)
    return min_p_filter(logits_BV, sampling.min_p)


def sample(logits_BV, key, sampling: SamplingConfig):
    """One token id per row, ``[B]`` int32."""
    if sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    filtered_BV = filter_logits(logits_BV, sampling)
    return jax.random.categorical(key, filtered_BV, axis=-1).astype(jnp.int32)
