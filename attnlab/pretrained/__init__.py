"""Hugging Face checkpoints (config.json + model.safetensors) as attnlab models.

``load_pretrained(path)`` returns a ``Pretrained`` handle. Each family (a ``model_type``) is
one file under ``families/`` that registers a ``Family`` (``family``): its config.json
translator, its tensor-name table (``mappings``), its config.json writer for export and any
rewrite of the stored tensors. ``configs`` translates config.json into a ``ModelConfig``,
``loader`` reads and converts, ``handle`` runs the model with Hugging Face-like arguments;
``export`` writes a model back as a Hugging Face folder (a run's: ``attnlab.runs.export``);
all three look the family up in the registry (docs/pretrained.md lists the built-ins).
"""

from attnlab import _moved
from attnlab.pretrained.configs import (
    UnsupportedCheckpointError,
    family_of,
    model_config_from_hf,
)
from attnlab.pretrained.export import ExportError, export_model
from attnlab.pretrained.family import (
    Family,
    get_family,
    register_family,
    registered_families,
    unregister_family,
)
from attnlab.pretrained.handle import Pretrained
from attnlab.pretrained.loader import (
    CheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    convert,
    load_pretrained,
    read_tensors,
)

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "ExportError",
    "Family",
    "MissingTensorError",
    "Pretrained",
    "TensorShapeError",
    "UnexpectedTensorError",
    "UnsupportedCheckpointError",
    "convert",
    "export_model",
    "family_of",
    "get_family",
    "load_pretrained",
    "model_config_from_hf",
    "read_tensors",
    "register_family",
    "registered_families",
    "unregister_family",
]


def __getattr__(name):
    if name == "FAMILIES":  # every registered family by model_type, the built-ins included
        return registered_families()
    return _moved.moved_name(__name__, name)  # the previous release's names, deprecated
