"""Hugging Face checkpoints (config.json + model.safetensors) as attnlab models.

``load_pretrained(path)`` returns a ``Pretrained`` handle. Families: gpt2, llama, mistral,
qwen2, qwen3, olmo2, phi3, gemma, gemma2, gemma3_text, mixtral, qwen3_moe, gpt_oss,
deepseek_v3, mamba2, qwen3_next, bamba, falcon_h1, nemotron_h, bert, bart, marian and t5
(docs/pretrained.md).
``configs`` translates config.json into a ``ModelConfig`` (one ``hf_*`` module per family
group), ``mappings`` and ``mappings_open`` hold one tensor-name table per family,
``loader`` reads and converts, ``handle`` runs the model with Hugging Face-like arguments;
``export`` writes a model back as a Hugging Face folder (a run's: ``attnlab.runs.export``).
"""

from attnlab import _moved
from attnlab.pretrained.configs import (
    FAMILIES,
    UnsupportedCheckpointError,
    family_of,
    model_config_from_hf,
)
from attnlab.pretrained.export import ExportError, export_model
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
    "MissingTensorError",
    "Pretrained",
    "TensorShapeError",
    "UnexpectedTensorError",
    "UnsupportedCheckpointError",
    "convert",
    "export_model",
    "family_of",
    "load_pretrained",
    "model_config_from_hf",
    "read_tensors",
]


def __getattr__(name):  # the previous release's names (attnlab._moved), deprecated
    return _moved.moved_name(__name__, name)
