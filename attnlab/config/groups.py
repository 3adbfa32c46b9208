"""``ModelConfig``'s fields, one frozen dataclass per concept.

Each group declares its fields once; ``ModelConfig`` inherits them all, so they are stored
and read flat (``cfg.n_heads``), and ``cfg.attention`` is the same values as an
``AttentionConfig``. A config is built flat, by group or both
(``ModelConfig(attention=AttentionConfig(n_heads=8), d_model=256)``); a group given whole
sets every field it holds, so the same field given flat as well is an error. Fields left
None take the values ``ModelConfig`` derives (see its docstring); a group on its own derives
and checks nothing.

Mixture-of-experts and recurrent sizes are no fields here: they are the settings of the
variant that reads them (``ffn_settings`` of ``ffn_variant="moe"``, ``mixer_settings`` of a
recurrent mixer), one settings type per variant.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

from attnlab.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackConfig:
    """The layer stack: the architecture, its width and depth, the kinds of layer in it and
    the multi-token prediction modules after it."""

    arch: str = "decoder"
    d_model: int = 128
    n_layers: int = 4
    n_decoder_layers: int | None = None  # encoder_decoder only; defaults to n_layers
    # The stack as an optional prefix of layer kinds and a repeating block of them (hybrid
    # stacks; attnlab.config.layer_kinds): {"prefix": [...], "block": [...]}, a BlockPattern once
    # built. None: the mixer and FFN variant of every layer.
    block_pattern: dict | None = None
    # Multi-token prediction (DeepSeek-V3): this many sequential modules after a decoder,
    # module k predicting the token k + 1 ahead (attnlab.nn.mtp); 0: none.
    mtp_depth: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingConfig:
    """Tokens in and out: the vocabulary, the embeddings and the output head."""

    vocab_size: int = 256
    type_vocab_size: int = 0  # token-type (segment) embeddings, BERT-style; 0 = none
    pad_id: int = 0
    tie_embeddings: bool = True
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model)
    logits_bias: bool = False  # a learned bias on the output logits
    logits_scale: float = 1.0  # multiplies the final hidden state before the output head
    logits_softcap: float | None = None  # caps output logits at c * tanh(z / c) (Gemma 2)
    mlm_transform: bool = True  # encoder: dense -> activation -> norm before the MLM head


@dataclasses.dataclass(frozen=True, kw_only=True)
class PositionConfig:
    """Where a token is: the position scheme, its settings and the longest sequence."""

    position: str = "learned"
    max_len: int = 256  # longest sequence the positions (and a KV cache) may reach
    position_offset: int = 0  # learned tables whose row 0 is position -offset (BART: 2)
    sinusoidal_layout: str = "interleaved"  # or "split" (all sines, then all cosines)
    rope_theta: float = 10000.0
    rotary_dim: int | None = None  # RoPE rotates the first rotary_dim head dims (None: all)
    # RoPE frequencies stretched for a longer context: a dict of attnlab.ops.RopeScaling's
    # fields, e.g. {"kind": "yarn", "factor": 32.0, "original_max_len": 4096}; None: plain.
    rope_scaling: Any = None
    relative_buckets: int = 32
    relative_max_distance: int = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """The sequence mixer: which variant, its heads, scores and which keys each query sees."""

    mixer: str = "mha"  # the self-attention variant: attnlab.registered_mixers()
    mixer_settings: Any = None  # the variant's Settings (a dict of its fields; None: defaults)
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    attn_scale: float | None = None  # logit scale; defaults to head_dim ** -0.5
    attn_bias: bool = False  # biases on the q/k/v projections
    out_bias: bool = False  # bias on the attention output projection
    qk_norm: bool = False  # RMS-normalise q and k per head (Qwen3)
    qk_norm_scope: str = "head"  # or "projection": over all heads at once (OLMo 2)
    attention_fn: str = "softmax"  # a score function from attnlab.attention_variants()
    causal: bool = True  # decoder self-attention is causal; False only for ablations
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None  # layers with a window; None = all
    # Per-layer window and RoPE base, repeated over the layers (Gemma's 5 local : 1 global):
    # a list of {"window": W | None, "rope_theta": R | None}; replaces sliding_window(_layers).
    layer_pattern: tuple | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FFNConfig:
    """The position-wise feed-forward sub-layer (``cfg.feedforward``: ``ffn`` names its
    activation): its variant, width, activation and bias."""

    ffn_variant: str = "dense"  # the FFN module: attnlab.registered_ffns() ("moe")
    ffn_settings: Any = None  # the FFN variant's Settings (a dict of its fields; None: defaults)
    d_ff: int | None = None
    ffn: str = "gelu"
    ffn_bias: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormConfig:
    """The normalisation layers: which norm, where it sits and which extra ones there are."""

    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    norm_bias: bool = True  # LayerNorm with a bias (ignored by rmsnorm)
    final_norm: bool | None = None  # defaults to False for post-norm, else True
    embedding_norm: bool = False  # a norm right after the embeddings (BERT, BART)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How the parameters start and train: dropout, the initialisation, and how it, the
    learning rates and the forward multipliers follow width and depth
    (``attnlab.nn.parametrization``)."""

    dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    # "standard", "mup" or "completep", relative to the base width (None: d_model) and base
    # depth (None: n_layers) where they equal the standard.
    parametrization: str = "standard"
    base_width: int | None = None
    base_depth: int | None = None
    residual_scale: float = 1.0  # multiplies every residual branch (CompleteP sets it)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionConfig:
    """How the model runs, not what it computes (the dtypes aside): the attention kernel,
    the split over a context mesh axis, scanning, rematerialisation, decoding and dtypes."""

    attention_impl: str = "auto"
    attention_block_q: int | None = None  # blockwise only: query block (None: its default)
    attention_block_k: int | None = None  # blockwise only: key block (None: its default)
    context_parallel: str = "ring"  # self-attention over mesh.context > 1: or "all_gather"
    context_load_balance: bool = True  # zigzag layout for causal stacks under the ring
    scan_layers: bool = True
    remat: str = "none"
    decode_layers: str = "auto"  # how generation loops run the decoder's layers
    dtype: str = "float32"  # activation / compute dtype
    param_dtype: str = "float32"


# The groups by the name ``ModelConfig`` reads and takes them under, in field order.
GROUPS = {
    "stack": StackConfig,
    "embedding": EmbeddingConfig,
    "positions": PositionConfig,
    "attention": AttentionConfig,
    "feedforward": FFNConfig,
    "norms": NormConfig,
    "training": TrainingConfig,
    "execution": ExecutionConfig,
}

# Each field -> the name of its group.
GROUP_OF = {f.name: name for name, cls in GROUPS.items() for f in dataclasses.fields(cls)}


def view(cfg, name: str):
    """Group ``name`` of ``cfg``: its fields' values (derived ones included)."""
    cls = GROUPS[name]
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


Group = TypeVar("Group")


class View(Generic[Group]):
    """A read-only attribute of ``ModelConfig``, named as its group in ``GROUPS``: that
    group of the config (``view``), e.g. ``attention = View(AttentionConfig)``."""

    def __init__(self, cls: type[Group]):
        self.cls, self.__doc__ = cls, cls.__doc__

    def __set_name__(self, owner, name):
        if GROUPS.get(name) is not self.cls:
            raise TypeError(f"{owner.__name__}.{name}: GROUPS[{name!r}] is not {self.cls.__name__}")
        self.name = name

    def __get__(self, cfg, owner=None) -> Group:
        return self if cfg is None else view(cfg, self.name)

    def __set__(self, cfg, value):
        raise AttributeError(f"ModelConfig.{self.name} is read-only: use replace")


def group_fields(name: str, group) -> dict[str, Any]:
    """Every field of group ``name`` given as one (a group config or a dict of its fields)."""
    cls = GROUPS[name]
    if isinstance(group, dict):
        unknown = sorted(set(group) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            where = ", ".join(f"{k} in {GROUP_OF[k]}" if k in GROUP_OF else k for k in unknown)
            raise ConfigError(f"ModelConfig.{name} has no field(s) {where}; see {cls.__name__}")
        group = cls(**group)
    if not isinstance(group, cls):
        raise ConfigError(
            f"ModelConfig.{name} takes a {cls.__name__} or a dict of its fields, not "
            f"{type(group).__name__}"
        )
    return {f.name: getattr(group, f.name) for f in dataclasses.fields(cls)}


def spread(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(flat, grouped)``: the flat fields of ``values`` and those its groups set. A field
    given both flat and by its group is one line naming both."""
    flat = {k: v for k, v in values.items() if k not in GROUPS}
    grouped = {}
    for name in GROUPS.keys() & values.keys():
        grouped.update(group_fields(name, values[name]))
    twice = sorted(grouped.keys() & flat.keys())
    if twice:
        groups = sorted({GROUP_OF[k] for k in twice})
        raise ConfigError(
            f"ModelConfig field(s) {', '.join(twice)} given twice, flat and in "
            f"{', '.join(groups)}: give each in one place"
        )
    return flat, grouped
