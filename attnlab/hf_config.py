"""Model configurations given as attnlab ``ModelConfig`` or as Hugging Face ``config.json``."""

from __future__ import annotations

import json
import os

from attnlab.config import ModelConfig


def as_model_config(cfg) -> ModelConfig:
    """``cfg`` itself, or the ``ModelConfig`` of a Hugging Face config (dict or path)."""
    if isinstance(cfg, ModelConfig):
        return cfg
    if isinstance(cfg, str | os.PathLike):
        path = os.fspath(cfg)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            cfg = json.load(f)
    if isinstance(cfg, dict):
        from attnlab.pretrained.configs import model_config_from_hf

        return model_config_from_hf(cfg)
    raise TypeError(f"expected a ModelConfig, a config.json path or a dict, got {type(cfg)}")
