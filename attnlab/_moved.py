"""The module paths and names of the previous release, deprecated: each still works, with one
``DeprecationWarning`` naming where it went, and goes in the next release (delete this file,
its import in ``attnlab/__init__.py`` and the ``__getattr__`` hooks that call ``moved_name``).

Importing it (``attnlab/__init__.py`` does, first) puts ``FINDER`` on ``sys.meta_path``:
``import attnlab.mixers`` then gives ``attnlab.contracts.mixer`` itself (the same module
object). A package's ``__getattr__`` hands its missing names to ``moved_name``, which finds
them in ``NAMES`` (``attnlab.pretrained.export_run``...). The new homes are looked up by
name, when an old one is used: no module of the package depends on them through this file.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "attnlab.architectures": "attnlab.config.architectures",
    "attnlab.checkpoint": "attnlab.runs.checkpoint",
    "attnlab.config_checks": "attnlab.config.checks",
    "attnlab.experiment_schema": "attnlab.experiment.schema",
    "attnlab.ffns": "attnlab.contracts.ffn",
    "attnlab.kv_ring": "attnlab.kv_cache.ring",
    "attnlab.layer_kinds": "attnlab.config.layer_kinds",
    "attnlab.mixers": "attnlab.contracts.mixer",
    "attnlab.nn.attention": "attnlab.nn.mixers.mha",
    "attnlab.optimizers": "attnlab.contracts.optimizer",
    "attnlab.pretrained.commands": "attnlab.runs.export",
    "attnlab.registry": "attnlab.contracts.registry",
    "attnlab.runs.surgery": "attnlab.runs.surgery_run",
    "attnlab.sample_command": "attnlab.runs.sample_command",
    "attnlab.sharding": "attnlab.devices.sharding",
    "attnlab.surgery": "attnlab.nn.surgery",
    "attnlab.variants": "attnlab.contracts.score_function",
}

NAMES = {
    "attnlab.nn.ARCHITECTURES": "attnlab.nn.models.MODEL_CLASSES",
    "attnlab.nn.models.ARCHITECTURES": "attnlab.nn.models.MODEL_CLASSES",
    "attnlab.pretrained.export_run": "attnlab.runs.export.export_run",
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} moved to {new}: use that (the old path goes in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        _warn(module.__name__, self.new, 2)
        sys.modules[module.__name__] = importlib.import_module(self.new)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Loader(new))


FINDER = _Finder()


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once): it answers the old names alone."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, FINDER)


install()


def module_getattr(module: str):
    """The ``__getattr__`` of a module whose previous release's names moved elsewhere:
    ``__getattr__ = module_getattr(__name__)`` answers them (``moved_name``), deprecated."""

    def __getattr__(name):
        return moved_name(module, name)

    return __getattr__


def moved_name(module: str, name: str):
    """``module.name`` where ``module`` no longer has it (its ``__getattr__`` asks): an old
    submodule or name, with its warning; ``AttributeError`` otherwise."""
    old = f"{module}.{name}"
    if old in MOVED:
        return importlib.import_module(old)  # the finder warns
    if old in NAMES:
        _warn(old, NAMES[old], 3)
        where, attr = NAMES[old].rsplit(".", 1)
        return getattr(importlib.import_module(where), attr)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
