"""Hugging Face ``config.json`` -> attnlab ``ModelConfig``, one translator per family.

The family comes from ``model_type`` (or, when that is absent, from ``architectures``).
Every architectural switch a family has is read and either mapped to a ``ModelConfig``
field or, when attnlab has no equivalent, rejected with an ``UnsupportedCheckpointError``
that names the config.json key. Dropout rates are not carried over: loaded models run in
evaluation mode.

Both config layouts are read: transformers v5 keeps RoPE settings in ``rope_parameters``,
older files use top-level ``rope_theta`` / ``rope_scaling``. The translators live in one
module per family group (``hf_classic``, ``hf_llama``, ``hf_gemma``, ...), their shared
helpers in ``hf_base``.
"""

from __future__ import annotations

import json
import os

from attnlab.config import ModelConfig
from attnlab.pretrained.hf_base import UnsupportedCheckpointError
from attnlab.pretrained.hf_classic import bart_like, bert, gpt2, t5
from attnlab.pretrained.hf_gemma import gemma
from attnlab.pretrained.hf_hybrid import bamba, falcon_h1
from attnlab.pretrained.hf_llama import llama_like
from attnlab.pretrained.hf_moe import deepseek_v3, gpt_oss, mixtral, qwen3_moe
from attnlab.pretrained.hf_nemotron_h import nemotron_h
from attnlab.pretrained.hf_qwen3_next import qwen3_next
from attnlab.pretrained.hf_ssm import mamba2

__all__ = ["FAMILIES", "UnsupportedCheckpointError", "family_of", "model_config_from_hf"]

FAMILIES = {
    "gpt2": gpt2,
    "llama": lambda c: llama_like(c, "llama"),
    "mistral": lambda c: llama_like(c, "mistral"),
    "qwen2": lambda c: llama_like(c, "qwen2"),
    "qwen3": lambda c: llama_like(c, "qwen3"),
    "olmo2": lambda c: llama_like(c, "olmo2"),
    "phi3": lambda c: llama_like(c, "phi3"),
    "gemma": lambda c: gemma(c, "gemma"),
    "gemma2": lambda c: gemma(c, "gemma2"),
    "gemma3_text": lambda c: gemma(c, "gemma3_text"),
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "gpt_oss": gpt_oss,
    "deepseek_v3": deepseek_v3,
    "mamba2": mamba2,
    "qwen3_next": qwen3_next,
    "bamba": bamba,
    "falcon_h1": falcon_h1,
    "nemotron_h": nemotron_h,
    "bert": bert,
    "bart": lambda c: bart_like(c, "bart"),
    "marian": lambda c: bart_like(c, "marian"),
    "t5": t5,
}

# Class-name prefixes in ``architectures``, for config files without ``model_type``.
_ARCHITECTURE_PREFIXES = {
    "GPT2": "gpt2",
    "Llama": "llama",
    "Mistral": "mistral",
    "Qwen2": "qwen2",
    "Qwen3Moe": "qwen3_moe",  # before its prefix Qwen3
    "Qwen3Next": "qwen3_next",  # before its prefix Qwen3
    "Qwen3": "qwen3",
    "Olmo2": "olmo2",
    "Phi3": "phi3",
    "Gemma": "gemma",
    "Gemma2": "gemma2",
    "Gemma3": "gemma3_text",
    "Mixtral": "mixtral",
    "DeepseekV3": "deepseek_v3",
    "GptOss": "gpt_oss",
    "Mamba2": "mamba2",
    "Bamba": "bamba",
    "FalconH1": "falcon_h1",
    "NemotronH": "nemotron_h",
    "Bert": "bert",
    "Bart": "bart",
    "Marian": "marian",
    "T5": "t5",
}


def family_of(c: dict) -> str:
    """The family key of a config.json dict (``model_type``, else ``architectures``)."""
    model_type = c.get("model_type")
    if model_type is None:
        for arch in c.get("architectures") or ():
            for prefix, family in _ARCHITECTURE_PREFIXES.items():
                rest = arch[len(prefix) :]
                if arch.startswith(prefix) and (rest[:1].isupper() or not rest):
                    return family
        raise UnsupportedCheckpointError(
            f"config.json has no model_type and architectures={c.get('architectures')!r} names "
            f"no supported family; supported model_type values: {sorted(FAMILIES)}"
        )
    if model_type not in FAMILIES:
        raise UnsupportedCheckpointError(
            f"config.json model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return model_type


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
    fields = FAMILIES[family_of(config)](config)
    fields.update(overrides)
    return ModelConfig(**fields)
