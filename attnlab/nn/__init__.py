"""Flax NNX modules that own parameters and call ``attnlab.ops``."""

from attnlab import _moved
from attnlab.contracts.score_function import attention_variants, get_attention, register_attention
from attnlab.nn.blocks import Block
from attnlab.nn.layers import Embed, FeedForward, LearnedPositions, Norm, RelativeBias
from attnlab.nn.mixers.mha import Attention
from attnlab.nn.models import (
    MODEL_CLASSES,
    DecoderLM,
    EncoderDecoder,
    EncoderMLM,
    ModelOutput,
    build_model,
    count_params,
)
from attnlab.nn.stack import Stack

__all__ = [
    "MODEL_CLASSES",
    "Attention",
    "Block",
    "DecoderLM",
    "Embed",
    "EncoderDecoder",
    "EncoderMLM",
    "FeedForward",
    "LearnedPositions",
    "ModelOutput",
    "Norm",
    "RelativeBias",
    "Stack",
    "attention_variants",
    "build_model",
    "count_params",
    "get_attention",
    "register_attention",
]


__getattr__ = _moved.module_getattr(__name__)  # the previous release's names, deprecated
