"""The registry of Hugging Face families: one ``Family`` per ``model_type``, holding all that
attnlab knows of it.

A family is data, defined in one file (``attnlab/pretrained/families/<name>.py`` for the
built-ins, or anywhere else)::

    register_family(Family(
        model_type="llama",
        config=llama_config,          # config.json dict -> ModelConfig fields (a dict)
        mapping=LLAMA,                # stored tensor names -> attnlab parameters
        write=llama_writer,           # ModelConfig -> config.json dict (export), optional
        prepare=None,                 # a rewrite of the stored tensors before the table
        finish=None,                  # export: prepare's inverse (fixed buffers, split tensors)
        architectures=("Llama",),     # class-name prefixes for config.json without model_type
    ))

The loader (``attnlab.pretrained.loader``), the translator (``configs.model_config_from_hf``)
and the exporter (``export.export_model``) look a family up here and never test for its
name. Export tries the families that have a writer in the order they were registered and
keeps the first whose config.json reads back as the model's own architecture, so a family
registered later (a special case of one before it) never takes a model an earlier one
describes. The built-ins register on first use (``registered_families``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from attnlab.pretrained.hf_base import UnsupportedCheckpointError
from attnlab.pretrained.mappings import Mapping

__all__ = [
    "Family",
    "family_of",
    "get_family",
    "register_family",
    "registered_families",
    "unregister_family",
]


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type`` (see the module docstring)."""

    model_type: str
    config: Callable[[dict], dict]  # config.json -> ModelConfig fields
    mapping: Mapping  # the tensor-name table (attnlab.pretrained.mappings)
    write: Callable | None = None  # ModelConfig -> config.json (export-hf); None: load only
    prepare: Callable[[dict, dict], dict] | None = None  # (tensors, config.json) -> tensors
    finish: Callable[[dict, dict], dict] | None = None  # export: (tensors, config.json) -> stored
    architectures: tuple[str, ...] = ()  # ``architectures`` class-name prefixes


_REGISTRY: dict[str, Family] = {}
_BUILTINS = "attnlab.pretrained.families"


def register_family(family: Family, *, overwrite: bool = False) -> Family:
    """Adds ``family`` under its ``model_type``; returns it."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family: expected a Family, got {type(family).__name__}")
    importlib.import_module(_BUILTINS)  # the built-ins first, whoever registers
    known = _REGISTRY.get(family.model_type)
    if known is not None and known is not family and not overwrite:
        raise ValueError(
            f"family {family.model_type!r} is registered; pass overwrite=True to replace it"
        )
    _REGISTRY[family.model_type] = family
    return family


def unregister_family(model_type: str) -> None:
    """Removes a family (one a test or a notebook registered)."""
    _REGISTRY.pop(model_type, None)


def registered_families() -> dict[str, Family]:
    """Every registered family by ``model_type``, the built-ins first, in registration order."""
    importlib.import_module(_BUILTINS)
    return dict(_REGISTRY)


def get_family(model_type: str) -> Family:
    """The family registered as ``model_type`` (an ``UnsupportedCheckpointError`` otherwise)."""
    known = registered_families()
    if model_type not in known:
        raise UnsupportedCheckpointError(
            f"config.json model_type={model_type!r} is not supported; supported: {sorted(known)}"
        )
    return known[model_type]


def family_of(c: dict) -> str:
    """The family key of a config.json dict: its ``model_type``, else the family with the
    longest class-name prefix of ``architectures`` (followed by a capital or the end)."""
    model_type = c.get("model_type")
    if model_type is not None:
        return get_family(model_type).model_type
    best = None
    for arch in c.get("architectures") or ():
        for family in registered_families().values():
            for prefix in family.architectures:
                rest = arch[len(prefix) :]
                fits = arch.startswith(prefix) and (rest[:1].isupper() or not rest)
                if fits and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), family)
    if best is None:
        raise UnsupportedCheckpointError(
            f"config.json has no model_type and architectures={c.get('architectures')!r} names "
            f"no supported family; supported model_type values: {sorted(registered_families())}"
        )
    return best[1].model_type
