"""Hugging Face ``config.json`` -> attnlab ``ModelConfig``, one translator per family.

The family comes from ``model_type`` (or, when that is absent, from ``architectures``) and is
looked up in the registry of families (``attnlab.pretrained.family``); each family's
translator lives in its file under ``attnlab/pretrained/families``.
Every architectural switch a family has is read and either mapped to a ``ModelConfig``
field or, when attnlab has no equivalent, rejected with an ``UnsupportedCheckpointError``
that names the config.json key. Dropout rates are not carried over: loaded models run in
evaluation mode.

Both config layouts are read: transformers v5 keeps RoPE settings in ``rope_parameters``,
older files use top-level ``rope_theta`` / ``rope_scaling``. The translators' shared helpers
are in ``hf_base``.
"""

from __future__ import annotations

import json
import os

from attnlab.config import ModelConfig
from attnlab.pretrained.family import Family, family_of, get_family
from attnlab.pretrained.hf_base import UnsupportedCheckpointError

__all__ = ["Family", "UnsupportedCheckpointError", "family_of", "model_config_from_hf"]


def model_config_from_hf(config, **overrides) -> ModelConfig:
    """The attnlab ``ModelConfig`` of a Hugging Face config.json: a dict, the file's path
    or its checkpoint folder.

    ``overrides`` replace fields afterwards (e.g. ``dtype="bfloat16"``).
    """
    if isinstance(config, str | os.PathLike):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}: pass a checkpoint folder")
        with open(path) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"expected a config.json dict or path, got {type(config).__name__}")
    fields = get_family(family_of(config)).config(config)
    fields.update(overrides)
    return ModelConfig(**fields)
