"""What the recurrent-state mixers (``gated_deltanet``, ``kda``, ``mamba2``) share: the settings
every one has (convolution kernel, chunk size, state dtype, form), which tokens of a call are
real, and the carried short convolution.

Each such layer keeps two fixed-size cache entries, named by role: ``"state"`` (the
recurrent state, ``[N, H, J]`` per row) and ``"conv"`` (the last ``W - 1`` inputs of its
short causal convolution, ``[W - 1, Z]``), both in ``state_dtype`` (float32 by default).
A call without a cache is training or a plain forward pass; with one it continues each row
from the cache (a prefill of T tokens, or a one-token recurrent step when T == 1) and puts
the final state back. Tokens that are not real leave the state as it was: in a plain pass,
the keys the mask marks invalid (left or right padding); with a cache, the tokens past each
row's count (a right-padded prefix).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from attnlab.contracts.mixer import CacheEntry, Mixer, MixerCall, MixerSettings
from attnlab.errors import ConfigError
from attnlab.ops.masks import MaskSpec
from attnlab.ops.precision import upcast
from attnlab.ops.recurrent import causal_conv

FORMS = ("chunked", "recurrent")
STATE_DTYPES = ("float32", "bfloat16")


def check_positive(settings, field, allow_none=True):
    """Fails ``settings.<field>`` unless it is a positive int (or None, when allowed)."""
    value = getattr(settings, field)
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        settings.fail(
            field, "a positive int" + (" (or None for the default)" if allow_none else "")
        )


def check_causal_conv(settings, cfg, usual: str) -> None:
    """Fails a causal, carried layer's settings unless the model is a decoder, ``conv_kernel``
    an int of at least 2 (``usual``: the taps its models use) and ``state_dtype`` one of
    ``STATE_DTYPES``."""
    if cfg.arch != "decoder":
        raise ConfigError(
            f"ModelConfig.arch={cfg.arch!r} is invalid with mixer={cfg.mixer!r}: the layer "
            "is causal and decodes from its carried state; use arch='decoder'"
        )
    c = settings.conv_kernel
    if not isinstance(c, int) or isinstance(c, bool) or c < 2:
        settings.fail("conv_kernel", f"an int of at least 2 ({usual})")
    if settings.state_dtype not in STATE_DTYPES:
        settings.fail("state_dtype", f"one of {STATE_DTYPES}")


def conv_uniform(key, shape, W: int, dtype):
    """Uniform in ``±W^-1/2``, torch's Conv1d initialisation (fan-in ``W`` taps): a short
    convolution's taps ``[W, Z]`` or its bias ``[Z]``."""
    bound = W**-0.5
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def conv_cache_entries(cfg, s):
    """The cache of a mixer whose one state is its short convolution's last ``W - 1``
    inputs, ``"conv"`` ``[W - 1, D]`` (``s``: its settings)."""
    return {"conv": CacheEntry((s.conv_kernel - 1, cfg.d_model), s.state_dtype, (None, None))}


def carried_conv(x_BTZ, call: MixerCall, valid_BT, w_WZ, bias_Z=None):
    """``(cache, y_BTZ)``: the short causal convolution of ``x`` after the call's cached
    ``"conv"`` inputs (a plain pass starts from zeros); the cache then holds its new inputs."""
    cache = call.cache
    state = None if cache is None else cache.read("conv")
    y_BTZ, state = causal_conv(x_BTZ, w_WZ, bias_Z, state, valid_BT)
    return (None if cache is None else cache.put("conv", state)), y_BTZ


@dataclasses.dataclass(frozen=True)
class RecurrentSettings(MixerSettings):
    """Settings every recurrent-state mixer has."""

    conv_kernel: int = 4  # taps W of the short causal depthwise convolution
    chunk_size: int = 64  # tokens per chunk of the chunked form (a power of two)
    state_dtype: str = "float32"  # the cache entries' dtype: float32 or bfloat16
    form: str = "chunked"  # training and prefill: "chunked", or "recurrent" (the per-token scan)

    def validate(self, cfg) -> None:
        check_causal_conv(self, cfg, "Qwen3-Next and Mamba-2 use 4")
        check_positive(self, "chunk_size", allow_none=False)
        if self.chunk_size & (self.chunk_size - 1):
            self.fail("chunk_size", "a power of two (64 by default)")
        if self.form not in FORMS:
            self.fail("form", f"one of {FORMS}")


def time_step_bias(key, n: int, lo=0.001, hi=0.1, floor=1e-4, dtype="float32"):
    """``[n]`` ``dt_bias`` for training from scratch (Mamba's and FLA's initialisation): the
    inverse softplus of time steps drawn log-uniformly from ``[lo, hi]`` (at least
    ``floor``), so each head starts with a slow decay and carries its state across the
    sequence."""
    dt = jnp.exp(jax.random.uniform(key, (n,), jnp.float32, math.log(lo), math.log(hi)))
    dt = jnp.maximum(dt, floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # softplus^-1


def token_validity(call: MixerCall, T: int):
    """``[B, T]`` bool of the call's real tokens, or None when all are real."""
    if call.cache is not None:  # a right-padded prefix of count_B tokens per row
        return jnp.arange(T, dtype=jnp.int32)[None, :] < call.cache.count_B[:, None]
    mask = call.mask
    if not isinstance(mask, MaskSpec):
        return None
    if mask.q_segment is not None:
        raise ConfigError(
            "a recurrent mixer does not reset its state between packed documents "
            "(segment_ids): train it on unpacked rows, one document per row"
        )
    valid = mask.k_valid
    if valid is not None and valid.shape[-1] != T:
        raise ValueError(f"recurrent mixer: key validity {valid.shape} for {T} tokens")
    return valid


def from_resolved(fn):
    """A ``(cls, cfg, settings)`` classmethod that answers ``fn`` of the settings resolved
    against ``cfg`` (``settings.resolved(cfg)``): a recurrent mixer's ``state_shape`` and
    ``conv_channels`` as formulas of its settings."""
    return classmethod(lambda cls, cfg, settings: fn(settings.resolved(cfg)))


class RecurrentMixer(Mixer):
    """Base of the recurrent-state mixers: their cache entries and carried convolution."""

    @classmethod
    def state_shape(cls, cfg, settings) -> tuple[int, int, int]:
        """``(N, H, J)``: one row's recurrent state."""
        raise NotImplementedError

    @classmethod
    def conv_channels(cls, cfg, settings) -> int:
        """``Z``: the channels of the short convolution."""
        raise NotImplementedError

    @classmethod
    def cache_entries(cls, cfg, settings):
        s = settings or cls.Settings()
        return {
            "state": CacheEntry(cls.state_shape(cfg, s), s.state_dtype, ("act_heads", None, None)),
            "conv": CacheEntry(
                (s.conv_kernel - 1, cls.conv_channels(cfg, s)), s.state_dtype, (None, None)
            ),
        }

    def initial_state(self, call: MixerCall):
        """The cached recurrent state (float32), or None for a plain pass."""
        return None if call.cache is None else upcast(call.cache.read("state"))
