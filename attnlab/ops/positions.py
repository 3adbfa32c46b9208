"""Position encodings as pure functions of explicit positions.

* ``sinusoidal``: the 2017 table, PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(...).
  ``layout="split"`` puts all sines first then all cosines (Marian, fairseq).
* RoPE: ``apply_rope(x_BTNH, positions_BT)`` rotates pairs (i, i + H/2): the half-split
  layout used by Llama, Mistral and Qwen. ``RopeScaling`` describes a context extension of
  its frequencies (``linear``, Llama 3.1's ``llama3``, ``yarn``, Phi-3's ``longrope``) and
  ``rope_frequencies`` computes the scaled inverse frequencies and the factor that multiplies
  the rotated dims (YaRN's and LongRoPE's attention factor).
* ALiBi: ``alibi_slopes(N)`` and ``alibi_bias`` (``-slope * |q_pos - k_pos|``).
* T5 relative position bias: ``relative_position_bucket`` and ``relative_position_bias``.
* ``PositionBias``: ALiBi, T5 or any bias of the same form as a *description* (the
  function, its parameters and the positions) that attention evaluates block by block, so
  that blockwise attention never builds ``[B, N, T, S]``.

Learned absolute positions are parameters, so they live in ``attnlab.nn``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.ops.precision import upcast, wide


def sinusoidal(num_positions, d, *, base=10000.0, layout="interleaved", dtype=jnp.float32):
    """[num_positions, d] sinusoidal table (computed in float64 with NumPy, then cast)."""
    if d % 2:
        raise ValueError(f"sinusoidal positions need an even width, got d={d}")
    if layout not in ("interleaved", "split"):
        raise ValueError(f"layout={layout!r}: use 'interleaved' (2017) or 'split' (sin | cos)")
    pos = np.arange(num_positions, dtype=np.float64)[:, None]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)[None, :]
    angles = pos * inv
    table = np.empty((num_positions, d), np.float64)
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    else:
        table[:, : d // 2], table[:, d // 2 :] = np.sin(angles), np.cos(angles)
    return jnp.asarray(table, dtype)


def rope_inv_frequencies(head_dim, theta=10000.0, *, dtype=jnp.float32):
    """[H/2] inverse frequencies theta^(-2i/H), computed in ``dtype``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim))


ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched for a longer context (``ModelConfig.rope_scaling``).

    ``kind``: ``"linear"`` (every frequency / ``factor``), ``"llama3"`` (Llama 3.1: low
    frequencies / ``factor``, high ones kept, a smooth ramp between the wavelengths
    ``original_max_len / low_freq_factor`` and ``/ high_freq_factor``), ``"yarn"`` (YaRN:
    a ramp between interpolated and original frequencies over the dims that turn
    ``beta_slow`` .. ``beta_fast`` times in ``original_max_len``; the rotated dims scaled by
    ``attention_factor``, by default ``0.1 ln(factor) + 1`` or DeepSeek's
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``), ``"longrope"`` (Phi-3: one
    divisor per frequency, ``short_factor`` while a call's positions stay within
    ``original_max_len``, ``long_factor`` beyond; ``attention_factor`` by default
    ``sqrt(1 + ln(factor) / ln(original_max_len))``). LongRoPE chooses per call: keys
    cached before a decoding step crosses ``original_max_len`` keep their short rotation
    (transformers' Phi-3 recomputes the whole sequence at that step instead).
    """

    kind: str
    factor: float = 1.0
    original_max_len: int | None = None  # the pretraining context (llama3, yarn, longrope)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dims
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn, longrope; None: the kind's default
    short_factor: tuple | None = None  # longrope, H/2 divisors
    long_factor: tuple | None = None  # longrope, H/2 divisors


def yarn_mscale(factor, mscale=1.0):
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor that multiplies the rotated dims of q and k (1 for most kinds)."""
    s = scaling
    if s is None or s.kind in ("linear", "llama3"):
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.kind == "yarn":
        if s.mscale and s.mscale_all_dim:
            return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
        return yarn_mscale(s.factor)
    if s.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_len))


def _llama3(inv, s: RopeScaling):
    low_wavelen = s.original_max_len / s.low_freq_factor
    high_wavelen = s.original_max_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(inv, dim, theta, s: RopeScaling):
    def correction_dim(rotations):
        turns = s.original_max_len / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dims), 0: interpolated
    return inv / s.factor * (1 - keep) + inv * keep


def rope_frequencies(
    head_dim, theta=10000.0, scaling: RopeScaling | None = None, *, long=False, dtype=jnp.float32
):
    """``(inv_h, attention_factor)``: the ``[H/2]`` inverse frequencies ``theta^(-2i/H)``
    under ``scaling`` (in ``dtype``; scaled ones computed in float64) and the factor on the
    rotated dims; ``long``: LongRoPE's factors for a call beyond ``original_max_len``."""
    if scaling is None:
        return rope_inv_frequencies(head_dim, theta, dtype=dtype), 1.0
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    theta = float(theta)  # scaled frequencies need a concrete base
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    s = scaling
    if s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "llama3":
        inv = _llama3(inv, s)
    elif s.kind == "yarn":
        inv = _yarn(inv, head_dim, theta, s)
    elif s.kind == "longrope":
        factors = np.asarray(s.long_factor if long else s.short_factor, np.float64)
        if factors.shape != inv.shape:
            raise ValueError(
                f"longrope needs {inv.shape[0]} factors for head_dim={head_dim}, "
                f"got {factors.shape[0]}"
            )
        inv = inv / factors
    else:
        raise ValueError(f"unknown RoPE scaling {s.kind!r}; use one of {ROPE_SCALINGS}")
    return jnp.asarray(inv, dtype), rope_attention_factor(s)


def _rope_angles(H, positions_BT, theta, scaling, dtype=jnp.float32):
    """``(angles_BTh, attention_factor)`` in ``dtype``; LongRoPE picks its long factors for a
    call whose positions pass ``original_max_len`` (as transformers decides per forward
    call)."""
    positions = jnp.asarray(positions_BT, dtype)
    inv_h, factor = rope_frequencies(H, theta, scaling, dtype=dtype)
    if scaling is not None and scaling.kind == "longrope":
        long_h, _ = rope_frequencies(H, theta, scaling, long=True, dtype=dtype)
        beyond = jnp.max(positions) + 1 > scaling.original_max_len
        inv_h = jnp.where(beyond, long_h, inv_h)
    return positions[..., None] * inv_h[None, None, :], factor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RopeChoice:
    """One layer's RoPE among a stack's few kinds: ``options[index]``, a ``(theta,
    scaling)`` pair (``(None, None)``: a NoPE layer, which leaves x as it is). ``index`` may
    be traced (the scan over layers); the options are static, so each kind's frequencies are
    computed from a concrete base (``jax.lax.switch``)."""

    index: Any
    options: tuple = dataclasses.field(metadata=dict(static=True))

    def __call__(self, x_BTNH, positions_BT, *, rotary_dim=None):
        """``apply_rope`` with this layer's base and scaling."""
        branches = [
            (lambda x, p: x)
            if theta is None
            else functools.partial(apply_rope, theta=theta, scaling=scaling, rotary_dim=rotary_dim)
            for theta, scaling in self.options
        ]
        if len(branches) == 1:
            return branches[0](x_BTNH, positions_BT)
        return jax.lax.switch(self.index, branches, x_BTNH, positions_BT)


def apply_rope(x_BTNH, positions_BT, *, theta=10000.0, rotary_dim=None, scaling=None):
    """Rotates ``x`` by its positions (half-split layout); computed in at least float32.

    ``rotary_dim`` (partial rotary, Phi-3): only the first ``rotary_dim`` head dims rotate,
    as a head of that size; the rest pass through. ``scaling``: a ``RopeScaling`` of the
    frequencies (its attention factor multiplies the rotated dims)."""
    if rotary_dim is not None and rotary_dim < x_BTNH.shape[-1]:
        rotated = apply_rope(x_BTNH[..., :rotary_dim], positions_BT, theta=theta, scaling=scaling)
        return jnp.concatenate([rotated, x_BTNH[..., rotary_dim:]], -1)
    H = x_BTNH.shape[-1]
    x = upcast(x_BTNH)
    angles_BTh, factor = _rope_angles(H, positions_BT, theta, scaling, x.dtype)
    sin_BT1h = jnp.sin(angles_BTh)[:, :, None, :] * factor
    cos_BT1h = jnp.cos(angles_BTh)[:, :, None, :] * factor
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    out = jnp.concatenate([x1 * cos_BT1h - x2 * sin_BT1h, x2 * cos_BT1h + x1 * sin_BT1h], -1)
    return out.astype(x_BTNH.dtype)


def alibi_slopes(num_heads):
    """[N] ALiBi head slopes (geometric; the paper's interpolation when N is not 2^k)."""

    def power_of_two(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(slopes, jnp.float32)


def alibi_bias(slopes_N, q_positions_BT, k_positions_BS):
    """[B, N, T, S] ALiBi bias ``-slope * |q_pos - k_pos|``."""
    q = jnp.asarray(q_positions_BT)[:, None, :, None]
    k = jnp.asarray(k_positions_BS)[:, None, None, :]
    return -upcast(slopes_N)[None, :, None, None] * jnp.abs(q - k).astype(wide(slopes_N))


def relative_position_bucket(
    relative_position, *, bidirectional=True, num_buckets=32, max_distance=128
):
    """T5's bucketing of ``k_pos - q_pos``: exact for small distances, log-spaced beyond."""
    rel = jnp.asarray(relative_position)
    bucket = jnp.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (rel > 0).astype(rel.dtype) * num_buckets
        rel = jnp.abs(rel)
    else:
        rel = -jnp.minimum(rel, 0)
    max_exact = num_buckets // 2
    is_small = rel < max_exact
    rel_f = jnp.maximum(rel, 1).astype(jnp.float32)
    large = max_exact + (
        jnp.log(rel_f / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(rel.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(is_small, rel, large)


def relative_position_bias(
    table_XN, q_positions_BT, k_positions_BS, *, bidirectional=True, max_distance=128
):
    """[B, N, T, S] bias gathered from a learned ``[num_buckets, N]`` table."""
    rel_BTS = jnp.asarray(k_positions_BS)[:, None, :] - jnp.asarray(q_positions_BT)[:, :, None]
    buckets_BTS = relative_position_bucket(
        rel_BTS,
        bidirectional=bidirectional,
        num_buckets=table_XN.shape[0],
        max_distance=max_distance,
    )
    return jnp.transpose(table_XN[buckets_BTS], (0, 3, 1, 2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PositionBias:
    """An additive logit bias ``fn(params, q_pos_BT, k_pos_BS, **options)`` ->
    ``[B|1, N|1, T, S]``, kept as a description so it can be evaluated per block.

    ``params`` is the pytree of arrays the bias reads (ALiBi slopes, a learned relative
    table); it is an explicit input rather than something ``fn`` closes over, so blockwise
    attention can return its gradient from a custom backward pass. ``fn`` and ``options``
    are static (hashable): pass a module-level function, not a fresh lambda, so that jitted
    functions taking a ``PositionBias`` do not retrace. ``dense()`` is the whole bias.
    """

    params: Any
    q_pos: Any  # [B|1, T] int32
    k_pos: Any  # [B|1, S] int32
    fn: Callable = dataclasses.field(default=None, metadata=dict(static=True))
    options: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @classmethod
    def alibi(cls, slopes_N, q_positions_BT, k_positions_BS):
        """ALiBi over these positions, as ``alibi_bias``."""
        return cls(slopes_N, q_positions_BT, k_positions_BS, fn=alibi_bias)

    @classmethod
    def relative(
        cls, table_XN, q_positions_BT, k_positions_BS, *, bidirectional=True, max_distance=128
    ):
        """T5 relative buckets over these positions, as ``relative_position_bias``."""
        options = (("bidirectional", bidirectional), ("max_distance", max_distance))
        return cls(
            table_XN, q_positions_BT, k_positions_BS, fn=relative_position_bias, options=options
        )

    def __call__(self, q_pos_BT, k_pos_BS, params=None):
        """The bias between the given positions (with other ``params`` when given)."""
        params = self.params if params is None else params
        return self.fn(params, q_pos_BT, k_pos_BS, **dict(self.options))

    def dense(self):
        """The whole ``[B|1, N, T, S]`` bias."""
        return self(self.q_pos, self.k_pos)

    def block(self, q_start, size_q, k_start, size_k, params=None):
        """The ``[B|1, N|1, size_q, size_k]`` block at (``q_start``, ``k_start``)."""
        q_pos = jax.lax.dynamic_slice_in_dim(self.q_pos, q_start, size_q, 1)
        k_pos = jax.lax.dynamic_slice_in_dim(self.k_pos, k_start, size_k, 1)
        return self(q_pos, k_pos, params)

    def replace(self, **changes):
        """A copy with ``changes`` to the fields."""
        return dataclasses.replace(self, **changes)

    def score_mod(self, q_offset=None):
        """The bias as a score function (``attnlab.ops.score_mods``), ``s + bias[b, h, q, k]``
        evaluated per entry and closing over ``params`` and the positions (so the fused
        kernels, which take no bias array, run it and return its gradient); None when
        ``fn`` has no per-entry form (``ELEMENTWISE``). ``q_offset`` ([B|1]): what the
        score function's query indices carry beyond the index into ``q_pos``."""
        entry = ELEMENTWISE.get(self.fn)
        if entry is None:
            return None
        options = dict(self.options)
        q_pos, k_pos = jnp.asarray(self.q_pos), jnp.asarray(self.k_pos)

        def mod(s, b, h, q_idx, kv_idx):
            if q_offset is not None:
                q_idx = q_idx - q_offset[b if q_offset.shape[0] > 1 else 0]
            qp = q_pos[b if q_pos.shape[0] > 1 else 0, q_idx]
            kp = k_pos[b if k_pos.shape[0] > 1 else 0, kv_idx]
            return s + entry(self.params, h, qp, kp, **options)

        return mod


def _alibi_entry(slopes_N, h, q_pos, k_pos):
    return -upcast(slopes_N[h]) * jnp.abs(q_pos - k_pos).astype(wide(slopes_N))


def _relative_entry(table_XN, h, q_pos, k_pos, *, bidirectional=True, max_distance=128):
    bucket = relative_position_bucket(
        k_pos - q_pos, bidirectional=bidirectional, num_buckets=table_XN.shape[0],
        max_distance=max_distance,
    )  # fmt: skip
    return upcast(table_XN[bucket, h])


# A bias function's value at one (head, query position, key position): what lets a
# ``PositionBias`` run as a score function.
ELEMENTWISE = {alibi_bias: _alibi_entry, relative_position_bias: _relative_entry}
