"""Flax NNX modules that own parameters and call ``attnlab.ops``."""

from attnlab.nn.attention import Attention
from attnlab.nn.blocks import Block
from attnlab.nn.layers import Embed, FeedForward, LearnedPositions, Norm, RelativeBias
from attnlab.nn.models import (
    ARCHITECTURES,
    DecoderLM,
    EncoderDecoder,
    EncoderMLM,
    ModelOutput,
    build_model,
    count_params,
)
from attnlab.nn.stack import Stack
from attnlab.variants import attention_variants, get_attention, register_attention

__all__ = [
    "ARCHITECTURES",
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
