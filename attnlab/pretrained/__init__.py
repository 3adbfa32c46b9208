"""Hugging Face checkpoints (config.json + model.safetensors) as attnlab models.

``load_pretrained(path)`` returns a ``Pretrained`` handle. Families: gpt2, llama, mistral,
qwen2, qwen3, bert, bart, marian and t5. ``configs`` translates config.json into a
``ModelConfig``, ``mappings`` holds one tensor-name table per family, ``loader`` reads and
converts, ``handle`` runs the model with Hugging Face-like arguments.
"""

from attnlab.pretrained.configs import (
    FAMILIES,
    UnsupportedCheckpointError,
    family_of,
    model_config_from_hf,
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
    "MissingTensorError",
    "Pretrained",
    "TensorShapeError",
    "UnexpectedTensorError",
    "UnsupportedCheckpointError",
    "convert",
    "family_of",
    "load_pretrained",
    "model_config_from_hf",
    "read_tensors",
]
