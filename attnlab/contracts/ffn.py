"""The feed-forward contract: a position-wise sub-layer (the plain FFN, a mixture of
experts) is a registered Flax NNX module that owns its parameters and names its settings,
as the sequence mixers are (``attnlab.contracts.mixer``)::

    @attnlab.register_ffn("moe")
    class MoE(attnlab.FFN):
        @dataclasses.dataclass(frozen=True)
        class Settings(attnlab.FFNSettings):     # validated, errors name the field
            n_experts: int = 8

        def __init__(self, cfg, settings, *, rngs): ...   # parameters (shape-suffixed)

        def __call__(self, x_BTD, *, key=None): ...       # -> out_BTD, or (out_BTD, aux)

``ModelConfig(ffn_variant="moe", ffn_settings={"n_experts": 8})`` builds it in every block;
``ModelConfig.ffn`` stays the activation (``"swiglu"``, ``"gelu"``...) the variant applies.

``aux`` is a dict of what the sub-layer reports besides its output: ``"loss"``, a scalar
added to the training objective (already weighted), and statistics (scalars or small
arrays) that the stack collects per layer into ``ModelOutput.aux``. A variant with nothing
to report returns the output alone. ``prefix_layers(cfg, settings)`` is the number of a
stack's first layers that take the plain FFN instead (DeepSeek's dense first layers).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from flax import nnx

from attnlab.contracts.registry import Registry, Settings


@dataclasses.dataclass(frozen=True)
class FFNSettings(Settings):
    """Base of a feed-forward variant's settings: a frozen dataclass of plain values
    (JSON-able); errors name ``ffn_settings.<field>``."""

    _field = "ffn_settings"


class FFN(nnx.Module):
    """Base class of feed-forward variants (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    Settings: ClassVar[type[FFNSettings]] = FFNSettings

    @classmethod
    def prefix_layers(cls, cfg, settings) -> int:
        """How many first layers of a stack take the plain FFN instead of this one."""
        return 0

    def __call__(self, x_BTD, *, key=None):
        raise NotImplementedError


_FFNS = Registry(
    "ffn",
    FFN,
    FFNSettings,
    field="ffn_variant",
    settings_field="ffn_settings",
    register="register_ffn",
    builtins={"dense": "attnlab.nn.layers", "moe": "attnlab.nn.moe", "none": "attnlab.nn.no_ffn"},
)


def register_ffn(name: str, cls: type[FFN] | None = None, *, overwrite: bool = False):
    """Registers ``cls`` as ``ModelConfig(ffn_variant=name)``; usable as a class decorator."""
    return _FFNS.register(name, cls, overwrite=overwrite)


# The registry's own lookups: what is registered, a name's class, a value as its Settings.
registered_ffns = _FFNS.all
"""Every registered feed-forward variant by name (the built-ins included)."""
get_ffn = _FFNS.get
make_ffn_settings = _FFNS.settings
