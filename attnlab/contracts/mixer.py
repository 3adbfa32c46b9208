"""The mixer contract: a sequence mixer (an attention variant, later a recurrent layer) is a
registered Flax NNX module that owns its parameters, names its settings and declares what it
keeps in the cache.

A variant supplies, in one class::

    @attnlab.register_mixer("sinks")
    class Sinks(attnlab.Mixer):
        @dataclasses.dataclass(frozen=True)
        class Settings(attnlab.MixerSettings):   # validated, errors name the field
            init: float = 0.0

        def __init__(self, cfg, settings, *, rngs): ...        # parameters (shape-suffixed)

        @classmethod
        def cache_entries(cls, cfg, settings): ...             # {"keys": CacheEntry, ...}

        def __call__(self, x_BTD, call: MixerCall): ...        # -> (out_BTD, cache, weights)

``ModelConfig(mixer="sinks", mixer_settings={"init": 1.0})`` then builds it in every
self-attention layer of every architecture; nothing in the library tests for the name.

The call. ``MixerCall`` holds what one layer's call needs besides ``x_BTD``: the query
positions, the mask (one ``ops.MaskSpec``: queries' and keys' positions and the rules;
``mask.dense()`` gives the array; a ``ContextMask`` when the sequence is split over the
mesh), the position bias description (``ops.PositionBias`` or None), the layer's RoPE base,
the dropout key, whether weights are asked for and, when decoding, the layer's cache
(``kv_cache.LayerCache``). Without a cache the call is training or a plain forward pass;
with one it is a prefill (T tokens) or a decode step (T = 1), and the variant appends its
per-token entries (``cache.append``) or replaces its fixed-size state (``cache.put``), then
returns the new ``LayerCache``. A variant whose decode step differs from its prefill (a
recurrence) tests ``call.cache is not None and x_BTD.shape[1] == 1``.

The cache contract. ``cache_entries`` maps each entry's role (``"keys"``, ``"values"``,
``"latent"``, ``"state"``, ``"conv"``...) to a ``CacheEntry``: its per-row shape, with
``SLOTS`` on the token axis of a per-token entry (keys, values, a compressed latent) or no
token axis at all for fixed-size state (a recurrent or convolution state); its dtype (None:
the cache's) and the logical axes that shard it. The cache stores each entry as ``[L, B,
*shape]`` (in a hybrid stack, over the layers that run the variant, under
``"<variant>.<role>"``; the variant still reads and writes it by role); per-token entries
are written at each row's slots (linear or ring buffer), state entries replaced whole.
``kv_cache_bytes`` sums the entries, so a variant's cache size follows from its config
alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
from flax import nnx, struct

from attnlab.contracts.registry import Registry, Settings

SLOTS = -1  # the token axis of a per-token cache entry, sized when the cache is built


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One role a variant keeps per layer in the cache (see the module docstring)."""

    shape: tuple[int, ...]
    dtype: str | None = None  # None: the cache's dtype (the model's compute dtype)
    axes: tuple[str | None, ...] | None = None  # logical axes of ``shape`` (None: replicated)

    @property
    def slot_axis(self) -> int | None:
        """Index of the token axis in ``shape``, or None for fixed-size state."""
        return self.shape.index(SLOTS) if SLOTS in self.shape else None

    def sized(self, slots: int) -> tuple[int, ...]:
        """The per-row shape with ``SLOTS`` replaced by ``slots``."""
        return tuple(slots if d == SLOTS else d for d in self.shape)


@dataclasses.dataclass(frozen=True)
class MixerSettings(Settings):
    """Base of a mixer's settings: a frozen dataclass of plain values (JSON-able); errors
    name ``mixer_settings.<field>``."""

    _field = "mixer_settings"


@struct.dataclass
class MixerCall:
    """Everything but ``x_BTD`` that one layer's mixer call receives."""

    positions_BT: jax.Array
    mask: Any = None  # ops.MaskSpec (or a ContextMask on a context-parallel mesh)
    bias: Any = None  # ops.PositionBias or None
    # This layer's RoPE: a base (traced inside the scan over layers) or, when some layer's
    # frequencies are scaled, an ops.RopeChoice of its base and scaling.
    rope_theta: Any = None
    cache: Any = None  # kv_cache.LayerCache while decoding, else None
    key: jax.Array | None = None  # dropout key (None: no dropout)
    layer: Any = None  # the layer's index in its stack (int32, traced inside the scan)
    return_weights: bool = struct.field(pytree_node=False, default=False)
    # Named per-layer statistics the caller asks for (``Stack``'s ``collect``): a mixer that
    # computes one sows it (``nnx.Intermediate``), reduced to scalars inside the layer.
    collect: tuple = struct.field(pytree_node=False, default=())

    @property
    def decoding(self) -> bool:
        """Whether the call holds a cache (a prefill or a decode step)."""
        return self.cache is not None


class Mixer(nnx.Module):
    """Base class of sequence-mixing variants (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    Settings: ClassVar[type[MixerSettings]] = MixerSettings
    # Whether the variant's maths is softmax attention over K/V blocks, so the stack may
    # hand it a sequence split over the mesh's context axis (a ``ContextMask``, whose
    # ``attend`` takes a ``score_mod`` and a ``softcap`` as well).
    context_parallel: ClassVar[bool] = False

    @classmethod
    def cache_entries(cls, cfg, settings) -> dict[str, CacheEntry]:
        """What one layer keeps in the cache: role -> ``CacheEntry`` (the default: nothing,
        so the variant cannot decode)."""
        raise NotImplementedError(f"mixer {cls.name!r} keeps no cache: it cannot decode")

    @classmethod
    def inherit(cls, cfg, settings, old: dict, new: dict) -> dict:
        """Model surgery's ``init="matching"``: the parameters of one layer of this variant
        (``new``: name -> its fresh array) that another mixer's (``old``: name -> array, the
        same layer) fill, with those values; parameters of the same name and shape are
        copied before this is asked. The default fills nothing more."""
        return {}

    def __call__(self, x_BTD, call: MixerCall):
        raise NotImplementedError


# The built-in variants, imported on first use (each registers itself).
_MIXERS = Registry(
    "mixer",
    Mixer,
    MixerSettings,
    field="mixer",
    settings_field="mixer_settings",
    register="register_mixer",
    builtins={
        "mha": "attnlab.nn.mixers.mha",
        "sinks": "attnlab.nn.mixers.sinks",
        "gated": "attnlab.nn.mixers.gated",
        "differential": "attnlab.nn.mixers.differential",
        "fox": "attnlab.nn.mixers.forgetting",
        "mla": "attnlab.nn.mixers.mla",
        "gated_deltanet": "attnlab.nn.mixers.gated_deltanet",
        "kda": "attnlab.nn.mixers.kda",
        "mamba2": "attnlab.nn.mixers.mamba2",
        "base_conv": "attnlab.nn.mixers.base_conv",
        "short_conv": "attnlab.nn.mixers.short_conv",
        "mamba": "attnlab.nn.mixers.mamba",
        "lightning": "attnlab.nn.mixers.lightning",
        "dsa": "attnlab.nn.mixers.sparse",
        "moba": "attnlab.nn.mixers.moba",
        "nsa": "attnlab.nn.mixers.nsa",
        "lolcats": "attnlab.nn.mixers.lolcats",
    },
)


def register_mixer(name: str, cls: type[Mixer] | None = None, *, overwrite: bool = False):
    """Registers ``cls`` as ``ModelConfig(mixer=name)``; usable as a class decorator."""
    return _MIXERS.register(name, cls, overwrite=overwrite)


# The registry's own lookups: what is registered, a name's class, a value as its Settings.
registered_mixers = _MIXERS.all
"""Every registered variant by name (the built-ins included)."""
get_mixer = _MIXERS.get
make_settings = _MIXERS.settings
