"""Typed, frozen, validated model configuration: ``ModelConfig`` (``attnlab.config.model``),
its fields by group (``attnlab.config.groups``) and the rules they follow
(``attnlab.config.checks``)."""

from attnlab.config.checks import (
    ARCHS,
    DECODE_LAYERS,
    DTYPES,
    NORM_PLACEMENTS,
    NORMS,
    POSITIONS,
    REMAT,
    rope_scaling_of,
    validate,
    validate_raw,
)
from attnlab.config.groups import (
    GROUPS,
    AttentionConfig,
    EmbeddingConfig,
    ExecutionConfig,
    FFNConfig,
    NormConfig,
    PositionConfig,
    StackConfig,
    TrainingConfig,
)
from attnlab.config.model import UNSTACKED_DECODE_MAX_LAYERS, LayerSpec, ModelConfig

__all__ = [
    "ARCHS",
    "AttentionConfig",
    "DECODE_LAYERS",
    "DTYPES",
    "EmbeddingConfig",
    "ExecutionConfig",
    "FFNConfig",
    "GROUPS",
    "LayerSpec",
    "ModelConfig",
    "NORMS",
    "NORM_PLACEMENTS",
    "NormConfig",
    "POSITIONS",
    "PositionConfig",
    "REMAT",
    "StackConfig",
    "TrainingConfig",
    "UNSTACKED_DECODE_MAX_LAYERS",
    "rope_scaling_of",
    "validate",
    "validate_raw",
]
