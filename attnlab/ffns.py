"""The feed-forward contract: a position-wise sub-layer (the plain FFN, a mixture of
experts) is a registered Flax NNX module that owns its parameters and names its settings,
as the sequence mixers are (``attnlab.mixers``)::

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
import importlib
from collections.abc import Mapping
from typing import ClassVar

from flax import nnx

from attnlab.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FFNSettings:
    """Base of a variant's settings: a frozen dataclass of plain values (JSON-able)."""

    def validate(self, cfg) -> None:
        """Raises ``ConfigError`` (``self.fail``) for values that do not fit ``cfg``."""

    def fail(self, field: str, fix: str):
        """Raises a ``ConfigError`` naming ``ffn_settings.<field>``, its value and ``fix``."""
        raise ConfigError(
            f"ModelConfig.ffn_settings.{field}={getattr(self, field)!r} is invalid: {fix}"
        )

    def to_dict(self) -> dict:
        """The settings as a plain, JSON-able dict."""
        return dataclasses.asdict(self)


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


_REGISTRY: dict[str, type[FFN]] = {}
_BUILTINS = {"dense": "attnlab.nn.layers", "moe": "attnlab.nn.moe"}


def register_ffn(name: str, cls: type[FFN] | None = None, *, overwrite: bool = False):
    """Registers ``cls`` as ``ModelConfig(ffn_variant=name)``; usable as a class decorator."""

    def register(cls):
        if not isinstance(name, str) or not name:
            raise TypeError(f"register_ffn: the name must be a non-empty str, got {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, FFN)):
            raise TypeError(f"register_ffn({name!r}): {cls!r} is not a subclass of FFN")
        settings = cls.Settings
        ok = isinstance(settings, type) and issubclass(settings, FFNSettings)
        if not (ok and dataclasses.is_dataclass(settings) and settings.__dataclass_params__.frozen):
            raise TypeError(f"ffn {name!r}: its Settings must be a frozen FFNSettings dataclass")
        if name in _REGISTRY and not overwrite and _REGISTRY[name] is not cls:
            raise ValueError(f"ffn {name!r} exists; pass overwrite=True to replace it")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register if cls is None else register(cls)


def registered_ffns() -> dict[str, type[FFN]]:
    """Every registered feed-forward variant by name (the built-ins included)."""
    for module in _BUILTINS.values():
        importlib.import_module(module)
    return dict(_REGISTRY)


def get_ffn(name: str) -> type[FFN]:
    if name not in _REGISTRY and name in _BUILTINS:
        importlib.import_module(_BUILTINS[name])
    if name not in _REGISTRY:
        raise ConfigError(
            f"ModelConfig.ffn_variant={name!r} is not registered: register it with "
            f"attnlab.register_ffn first; known: {sorted(registered_ffns())}"
        )
    return _REGISTRY[name]


def make_ffn_settings(name: str, value) -> FFNSettings:
    """``value`` (None, a mapping or the variant's Settings) as variant ``name``'s Settings."""
    settings_cls = get_ffn(name).Settings
    if value is None:
        return settings_cls()
    if isinstance(value, settings_cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"ModelConfig.ffn_settings={value!r} is invalid: pass a dict of "
            f"{settings_cls.__name__}'s fields, or None for the defaults"
        )
    fields = {f.name for f in dataclasses.fields(settings_cls)}
    value = {k: v for k, v in value.items() if k in fields or v is not None}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ConfigError(
            f"ModelConfig.ffn_settings has unknown field(s) {unknown} for "
            f"ffn_variant={name!r}; its fields are {sorted(fields)}"
        )
    return settings_cls(**value)
