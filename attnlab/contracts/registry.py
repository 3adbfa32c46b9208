"""One registry of modules by name, for every extension point whose members carry their own
settings: the sequence mixers (``attnlab.contracts.mixer``) and the feed-forward variants
(``attnlab.contracts.ffn``). A member is a class with a ``Settings`` frozen dataclass (a subclass of
the registry's settings base); built-ins are imported on first use and register themselves.
Errors are ``ConfigError`` lines naming the ``ModelConfig`` field.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping

from attnlab.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of a variant's settings: a frozen dataclass of plain values (JSON-able)."""

    _field = "settings"  # the ModelConfig field that holds them (set per registry)

    def validate(self, cfg) -> None:
        """Raises ``ConfigError`` (``self.fail``) for values that do not fit ``cfg``."""

    def fail(self, field: str, fix: str):
        """Raises a ``ConfigError`` naming ``<settings field>.<field>``, its value and ``fix``."""
        raise ConfigError(
            f"ModelConfig.{self._field}.{field}={getattr(self, field)!r} is invalid: {fix}"
        )

    def to_dict(self) -> dict:
        """The settings as a plain, JSON-able dict."""
        return dataclasses.asdict(self)


class Registry:
    """Classes by name: ``kind`` names them in errors, ``field`` and ``settings_field`` are
    the ``ModelConfig`` fields that select one and hold its settings, ``builtins`` maps
    names to the modules that register them."""

    def __init__(self, kind, base, settings_base, *, field, settings_field, register, builtins):
        self.kind, self.base, self.settings_base = kind, base, settings_base
        self.field, self.settings_field, self.register_name = field, settings_field, register
        self.builtins, self.classes = dict(builtins), {}

    def register(self, name: str, cls=None, *, overwrite: bool = False):
        """Registers ``cls`` under ``name``; usable as a class decorator."""

        def add(cls):
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"{self.register_name}: the name must be a non-empty str, got {name!r}"
                )
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(
                    f"{self.register_name}({name!r}): {cls!r} is not a subclass of "
                    f"{self.base.__name__}"
                )
            s = cls.Settings
            ok = isinstance(s, type) and issubclass(s, self.settings_base)
            if not (ok and dataclasses.is_dataclass(s) and s.__dataclass_params__.frozen):
                raise TypeError(
                    f"{self.kind} {name!r}: its Settings must be a frozen "
                    f"{self.settings_base.__name__} dataclass"
                )
            if name in self.classes and not overwrite and self.classes[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} exists; pass overwrite=True to replace it")
            cls.name = name
            self.classes[name] = cls
            return cls

        return add if cls is None else add(cls)

    def all(self) -> dict:
        """Every registered class by name (the built-ins included)."""
        for module in self.builtins.values():
            importlib.import_module(module)
        return dict(self.classes)

    def get(self, name: str):
        """The class registered as ``name`` (a ``ConfigError`` listing them otherwise)."""
        if name not in self.classes and name in self.builtins:
            importlib.import_module(self.builtins[name])
        if name not in self.classes:
            raise ConfigError(
                f"ModelConfig.{self.field}={name!r} is not registered: register it with "
                f"attnlab.{self.register_name} first; known: {sorted(self.all())}"
            )
        return self.classes[name]

    def settings(self, name: str, value):
        """``value`` (None, a mapping or the class's Settings) as ``name``'s Settings."""
        settings_cls, where = self.get(name).Settings, f"ModelConfig.{self.settings_field}"
        if value is None:
            return settings_cls()
        if isinstance(value, settings_cls):
            return value
        if isinstance(value, self.settings_base):
            raise ConfigError(
                f"{where} is a {type(value).__name__}, but {self.field}={name!r} takes "
                f"{settings_cls.__name__}: pass that, a dict of its fields, or None"
            )
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{where}={value!r} is invalid: pass a dict of {settings_cls.__name__}'s "
                "fields, or None for the defaults"
            )
        fields = {f.name for f in dataclasses.fields(settings_cls)}
        # A field left None means "the default" in any variant's settings: one carried over
        # from the variant a config held before (a sweep changing the variant) is dropped.
        value = {k: v for k, v in value.items() if k in fields or v is not None}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ConfigError(
                f"{where} has unknown field(s) {unknown} for {self.field}={name!r}; its "
                f"fields are {sorted(fields)}"
            )
        return settings_cls(**{k: _hashable(v) for k, v in value.items()})


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
