"""Typed, frozen, validated model configuration.

One ``ModelConfig`` describes all three architectures (``arch``): a decoder-only language
model, an encoder-only masked language model and the 2017 encoder-decoder. Every
architectural choice is a field; ``validate`` (run on construction) rejects inconsistent
values with a ``ValueError`` that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnlab.errors import ConfigError
from attnlab.ffns import get_ffn, make_ffn_settings
from attnlab.mixers import get_mixer, make_settings
from attnlab.ops.activations import FFN_KINDS
from attnlab.ops.attention import IMPLEMENTATIONS
from attnlab.ops.context_parallel import METHODS as CONTEXT_PARALLEL
from attnlab.variants import attention_variants

ARCHS = ("decoder", "encoder", "encoder_decoder")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "relative", "none")
NORMS = ("layernorm", "rmsnorm")
# pre: x + f(norm(x)); post: norm(x + f(x)); sandwich: x + norm2(f(norm1(x))) (Gemma 2/3);
# output: x + norm(f(x)) (OLMo 2).
NORM_PLACEMENTS = ("pre", "post", "sandwich", "output")
DTYPES = ("float32", "bfloat16", "float16")
REMAT = ("none", "full", "dots")
DECODE_LAYERS = ("auto", "unstacked", "scan")
# Beyond this many decoder layers, "auto" decoding scans: the unrolled loop body's compile
# time grows with depth (about 0.5 s a layer on a 2-core CPU) and stops paying for itself.
UNSTACKED_DECODE_MAX_LAYERS = 12


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one layer of ``ModelConfig.layer_pattern`` changes: its sliding window (None:
    global attention) and its RoPE base (None: ``ModelConfig.rope_theta``)."""

    window: int | None = None
    rope_theta: float | None = None

    @classmethod
    def of(cls, value) -> LayerSpec:
        if isinstance(value, LayerSpec):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"window", "rope_theta"})
            if unknown:
                _fail("layer_pattern", value, f"unknown key(s) {unknown}: use window, rope_theta")
            return cls(**value)
        if value in ("global", None):
            return cls()
        _fail("layer_pattern", value, "list dicts {'window': W, 'rope_theta': R} or 'global'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """All architectural choices of an attnlab model.

    Fields left as None take a value derived from the others on construction, and
    ``replace`` derives them again: ``n_kv_heads`` from ``n_heads`` (MHA; fewer gives GQA,
    1 gives MQA), ``head_dim`` is ``d_model // n_heads``, ``d_ff`` is ``4 * d_model``,
    ``n_decoder_layers`` is ``n_layers``, ``final_norm`` is False for post-norm (else True) and
    ``attn_scale`` is ``head_dim ** -0.5``. ``to_dict`` writes them as None again.

    Execution: ``scan_layers`` applies each stack's layers (parameters stacked on a leading
    layer axis) with ``lax.scan``, so the traced program does not grow with depth; False
    unrolls the same parameters in a Python loop. ``remat`` rematerialises each layer in
    the backward pass: ``"none"``, ``"full"`` (save only the layer inputs) or ``"dots"``
    (save the outputs of the weight matmuls, recompute the rest). ``attention_impl`` picks
    the attention implementation (``attnlab.ops.attention``); ``"chunked"`` is blockwise with
    memory linear in the sequence length, its blocks ``attention_block_q``/``_k``; the default
    ``"auto"`` takes the chunked path on CPU from 128 queries on (measured faster there) and
    lets ``jax.nn.dot_product_attention`` choose elsewhere (cuDNN on a GPU where it applies).

    ``decode_layers`` is how the generation loops (sampling, beam search) run the decoder:
    ``"unstacked"`` slices the stacked weights into separate blocks once per call and
    unrolls the layers in the loop body, so each token reads every weight where it lies
    (fastest per token; the program grows with depth); ``"scan"`` scans the stacked
    weights at every token (program flat in depth, but each step slices every layer's
    weights: on CPU, a copy); ``"auto"`` is ``"unstacked"`` up to
    ``UNSTACKED_DECODE_MAX_LAYERS`` decoder layers and ``"scan"`` beyond.

    ``context_parallel`` is how self-attention runs when the mesh splits the sequence
    (``mesh.context > 1``; see ``attnlab.ops.context_parallel``): ``"ring"`` passes
    key/value chunks round the devices, ``"all_gather"`` gathers them all on each device.
    ``context_load_balance`` gives causal stacks the zigzag layout under the ring, so every
    device does the same work. Neither changes anything on a mesh without a context axis.
    """

    arch: str = "decoder"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_decoder_layers: int | None = None  # encoder_decoder only; defaults to n_layers
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    max_len: int = 256  # longest sequence the positions (and a KV cache) may reach

    position: str = "learned"
    position_offset: int = 0  # learned tables whose row 0 is position -offset (BART: 2)
    sinusoidal_layout: str = "interleaved"  # or "split" (all sines, then all cosines)
    rope_theta: float = 10000.0
    rotary_dim: int | None = None  # RoPE rotates the first rotary_dim head dims (None: all)
    relative_buckets: int = 32
    relative_max_distance: int = 128

    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    norm_bias: bool = True  # LayerNorm with a bias (ignored by rmsnorm)
    final_norm: bool | None = None  # defaults to False for post-norm, else True
    embedding_norm: bool = False  # a norm right after the embeddings (BERT, BART)
    qk_norm: bool = False  # RMS-normalise q and k per head (Qwen3)
    qk_norm_scope: str = "head"  # or "projection": over all heads at once (OLMo 2)

    ffn: str = "gelu"
    ffn_variant: str = "dense"  # the FFN module: attnlab.registered_ffns() ("moe")
    ffn_settings: Any = None  # the FFN variant's Settings (a dict of its fields; None: defaults)
    attn_bias: bool = False  # biases on the q/k/v projections
    out_bias: bool = False  # bias on the attention output projection
    ffn_bias: bool = False

    tie_embeddings: bool = True
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model)
    logits_bias: bool = False  # a learned bias on the output logits
    logits_scale: float = 1.0  # multiplies the final hidden state before the output head
    logits_softcap: float | None = None  # caps output logits at c * tanh(z / c) (Gemma 2)
    type_vocab_size: int = 0  # token-type (segment) embeddings, BERT-style; 0 = none
    mlm_transform: bool = True  # encoder: dense -> activation -> norm before the MLM head

    dropout: float = 0.0
    attention_dropout: float = 0.0
    causal: bool = True  # decoder self-attention is causal; False only for ablations
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None  # layers with a window; None = all
    attn_scale: float | None = None  # logit scale; defaults to head_dim ** -0.5
    attention_impl: str = "auto"
    attention_block_q: int | None = None  # chunked only: query block (None: its default)
    attention_block_k: int | None = None  # chunked only: key block (None: its default)
    attention_fn: str = "softmax"  # a score function from attnlab.attention_variants()
    mixer: str = "mha"  # the self-attention variant: attnlab.registered_mixers()
    mixer_settings: Any = None  # the variant's Settings (a dict of its fields; None: defaults)
    # Per-layer window and RoPE base, repeated over the layers (Gemma's 5 local : 1 global):
    # a list of {"window": W | None, "rope_theta": R | None}; replaces sliding_window(_layers).
    layer_pattern: tuple | None = None
    context_parallel: str = "ring"  # self-attention over mesh.context > 1: or "all_gather"
    context_load_balance: bool = True  # zigzag layout for causal stacks under the ring

    scan_layers: bool = True
    remat: str = "none"
    decode_layers: str = "auto"  # how generation loops run the decoder's layers

    dtype: str = "float32"  # activation / compute dtype
    param_dtype: str = "float32"
    init_std: float = 0.02
    pad_id: int = 0

    # Names of the fields that were None and got derived values (not part of equality).
    _derived: frozenset = dataclasses.field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self):
        if isinstance(self.sliding_window_layers, list):
            object.__setattr__(self, "sliding_window_layers", tuple(self.sliding_window_layers))
        if self.layer_pattern is not None:
            if not isinstance(self.layer_pattern, (list, tuple)) or not self.layer_pattern:
                _fail("layer_pattern", self.layer_pattern, "a non-empty list of layer specs")
            pattern = tuple(LayerSpec.of(v) for v in self.layer_pattern)
            object.__setattr__(self, "layer_pattern", pattern)
        if not isinstance(self.mixer, str):
            _fail("mixer", self.mixer, "name a registered mixer (attnlab.registered_mixers())")
        object.__setattr__(self, "mixer_settings", make_settings(self.mixer, self.mixer_settings))
        if not isinstance(self.ffn_variant, str):
            _fail(
                "ffn_variant", self.ffn_variant, "name a registered FFN (attnlab.registered_ffns())"
            )
        settings = make_ffn_settings(self.ffn_variant, self.ffn_settings)
        object.__setattr__(self, "ffn_settings", settings)
        validate_raw(self)
        derived = set()
        for name, value in _derivations(self):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
                derived.add(name)
        object.__setattr__(self, "_derived", frozenset(derived))
        validate(self)

    @property
    def decode_unstacked(self) -> bool:
        """Whether generation loops run the decoder's layers unstacked (``decode_layers``)."""
        if self.decode_layers == "auto":
            return self.stack_layers <= UNSTACKED_DECODE_MAX_LAYERS
        return self.decode_layers == "unstacked"

    @property
    def stack_layers(self) -> int:
        """Layers of the stack that a KV cache serves (the decoder's)."""
        return self.n_decoder_layers if self.arch == "encoder_decoder" else self.n_layers

    def layer_windows(self, n_layers: int) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention): the one place this rule is
        read, from ``layer_pattern`` or ``sliding_window``/``sliding_window_layers``."""
        if self.layer_pattern is not None:
            p = self.layer_pattern
            return tuple(p[i % len(p)].window for i in range(n_layers))
        chosen = self.sliding_window_layers
        return tuple(
            self.sliding_window if chosen is None or i in chosen else None for i in range(n_layers)
        )

    def layer_rope_thetas(self, n_layers: int) -> tuple[float, ...]:
        """Each layer's RoPE base, from ``layer_pattern`` or ``rope_theta``."""
        p = self.layer_pattern
        if p is None:
            return (self.rope_theta,) * n_layers
        return tuple(p[i % len(p)].rope_theta or self.rope_theta for i in range(n_layers))

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``; fields that were derived are derived again (and a new
        ``mixer`` takes its default settings unless ``mixer_settings`` is given)."""
        values = self.to_dict()
        if "mixer" in changes and changes["mixer"] != self.mixer:
            values["mixer_settings"] = None
        if "ffn_variant" in changes and changes["ffn_variant"] != self.ffn_variant:
            values["ffn_settings"] = None
        values.update(changes)
        return ModelConfig(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields as given: derived ones are None, so ``from_dict`` derives them again;
        the variant's settings and the layer pattern as plain dicts."""
        out = {
            f.name: None if f.name in self._derived else getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init
        }
        out["mixer_settings"] = self.mixer_settings.to_dict()
        out["ffn_settings"] = self.ffn_settings.to_dict()
        if self.layer_pattern is not None:
            out["layer_pattern"] = [dataclasses.asdict(p) for p in self.layer_pattern]
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """The config ``to_dict`` (or ``config.json``) wrote; an unknown key is an error."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"ModelConfig has no field(s) {unknown}; valid fields are {sorted(names)}"
            )
        return cls(**values)


def _fail(field, value, fix):
    raise ConfigError(f"ModelConfig.{field}={value!r} is invalid: {fix}")


def _choice(cfg, field, options):
    value = getattr(cfg, field)
    if value not in options:
        _fail(field, value, f"use one of {list(options)}")


def _derivations(cfg: ModelConfig):
    """(field, value) for every field that None derives, in dependency order."""
    yield "n_kv_heads", cfg.n_heads
    if cfg.head_dim is None and cfg.d_model % cfg.n_heads:
        _fail(
            "d_model",
            cfg.d_model,
            f"d_model must be divisible by n_heads={cfg.n_heads}, or set head_dim explicitly",
        )
    yield "head_dim", cfg.d_model // cfg.n_heads
    yield "d_ff", 4 * cfg.d_model
    yield "n_decoder_layers", cfg.n_layers
    yield "final_norm", cfg.norm_placement != "post"
    yield "attn_scale", (cfg.head_dim or cfg.d_model // cfg.n_heads) ** -0.5


def validate_raw(cfg: ModelConfig) -> None:
    """Checks the sizes that derived values are computed from."""
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(field, value, "must be a positive integer")
    optional = ("n_decoder_layers", "n_kv_heads", "head_dim", "d_ff", "sliding_window")
    for field in optional + ("attention_block_q", "attention_block_k"):
        value = getattr(cfg, field)
        if value is not None and (not isinstance(value, int) or value <= 0):
            _fail(field, value, "must be a positive integer, or None for the default")


def validate(cfg: ModelConfig) -> None:
    """Raises ``ValueError`` naming the offending field and the fix."""
    validate_raw(cfg)
    _choice(cfg, "arch", ARCHS)
    _choice(cfg, "position", POSITIONS)
    _choice(cfg, "norm", NORMS)
    _choice(cfg, "norm_placement", NORM_PLACEMENTS)
    _choice(cfg, "qk_norm_scope", ("head", "projection"))
    if cfg.arch == "encoder_decoder" and cfg.norm_placement not in ("pre", "post"):
        _fail("norm_placement", cfg.norm_placement, "encoder_decoder takes 'pre' or 'post'")
    rd = cfg.rotary_dim
    if rd is not None and not (isinstance(rd, int) and 0 < rd <= cfg.head_dim and rd % 2 == 0):
        _fail("rotary_dim", rd, f"an even number of head dims in (0, head_dim={cfg.head_dim}]")
    cap = cfg.logits_softcap
    if cap is not None and not (isinstance(cap, int | float) and 0 < cap < float("inf")):
        _fail("logits_softcap", cap, "a positive number (Gemma 2 uses 30.0), or None")
    _choice(cfg, "ffn", FFN_KINDS)
    _choice(cfg, "attention_impl", IMPLEMENTATIONS)
    _choice(cfg, "dtype", DTYPES)
    _choice(cfg, "param_dtype", DTYPES)
    _choice(cfg, "sinusoidal_layout", ("interleaved", "split"))
    _choice(cfg, "remat", REMAT)
    _choice(cfg, "decode_layers", DECODE_LAYERS)
    for field in ("attention_block_q", "attention_block_k"):
        value = getattr(cfg, field)
        if value is not None and cfg.attention_impl != "chunked":
            _fail(
                field, value, "block sizes apply to attention_impl='chunked' only; set it or None"
            )
    if cfg.attention_impl == "chunked" and cfg.attention_dropout > 0:
        _fail(
            "attention_dropout",
            cfg.attention_dropout,
            "attention_impl='chunked' has no attention dropout: set it to 0, or use "
            "attention_impl='reference'",
        )
    _choice(cfg, "context_parallel", CONTEXT_PARALLEL)
    if not isinstance(cfg.context_load_balance, bool):
        _fail("context_load_balance", cfg.context_load_balance, "must be True or False")
    if not isinstance(cfg.scan_layers, bool):
        _fail("scan_layers", cfg.scan_layers, "must be True (lax.scan) or False (unrolled)")
    chosen = cfg.sliding_window_layers
    if chosen is not None:
        if cfg.sliding_window is None:
            _fail("sliding_window_layers", chosen, "set sliding_window too, or leave it None")
        n = max(cfg.n_layers, cfg.n_decoder_layers)
        if not all(isinstance(i, int) and 0 <= i < n for i in chosen):
            _fail("sliding_window_layers", chosen, f"list layer indices in [0, {n})")
    if cfg.layer_pattern is not None:
        if cfg.sliding_window is not None or cfg.sliding_window_layers is not None:
            _fail(
                "layer_pattern",
                cfg.layer_pattern,
                "it sets each layer's window: leave sliding_window and sliding_window_layers None",
            )
        for spec in cfg.layer_pattern:
            if spec.window is not None and (not isinstance(spec.window, int) or spec.window < 1):
                _fail("layer_pattern", spec, "a window must be a positive integer or None")
            if spec.rope_theta is not None and spec.rope_theta <= 0:
                _fail("layer_pattern", spec, "a rope_theta must be positive or None")
        if cfg.arch == "encoder" and any(s.window is not None for s in cfg.layer_pattern):
            _fail("layer_pattern", cfg.layer_pattern, "sliding windows are causal: decoders only")
    if not isinstance(cfg.mixer_settings, get_mixer(cfg.mixer).Settings):
        _fail("mixer_settings", cfg.mixer_settings, f"settings of mixer={cfg.mixer!r}")
    cfg.mixer_settings.validate(cfg)
    if not isinstance(cfg.ffn_settings, get_ffn(cfg.ffn_variant).Settings):
        _fail("ffn_settings", cfg.ffn_settings, f"settings of ffn_variant={cfg.ffn_variant!r}")
    cfg.ffn_settings.validate(cfg)
    if cfg.attention_fn not in attention_variants():
        _fail(
            "attention_fn",
            cfg.attention_fn,
            f"register it with attnlab.nn.register_attention first; known: "
            f"{sorted(attention_variants())}",
        )
    if cfg.n_heads % cfg.n_kv_heads:
        _fail(
            "n_kv_heads",
            cfg.n_kv_heads,
            f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads (use a divisor of it)",
        )
    if cfg.position == "rope" and cfg.head_dim % 2:
        _fail("head_dim", cfg.head_dim, "RoPE rotates pairs, so the head dim must be even")
    if cfg.position == "sinusoidal" and cfg.d_model % 2:
        _fail("d_model", cfg.d_model, "sinusoidal positions need an even d_model")
    if cfg.rope_theta <= 0:
        _fail("rope_theta", cfg.rope_theta, "must be positive")
    if cfg.position_offset < 0:
        _fail("position_offset", cfg.position_offset, "must be >= 0")
    if cfg.relative_buckets < 2 or cfg.relative_max_distance < 1:
        _fail(
            "relative_buckets",
            cfg.relative_buckets,
            "need relative_buckets >= 2 and relative_max_distance >= 1",
        )
    for field in ("dropout", "attention_dropout"):
        value = getattr(cfg, field)
        if not 0.0 <= value < 1.0:
            _fail(field, value, "a dropout rate must lie in [0, 1)")
    if cfg.norm_eps <= 0:
        _fail("norm_eps", cfg.norm_eps, "must be positive")
    if cfg.init_std <= 0:
        _fail("init_std", cfg.init_std, "must be positive")
    if not 0 <= cfg.pad_id < cfg.vocab_size:
        _fail("pad_id", cfg.pad_id, f"must be a token id in [0, vocab_size={cfg.vocab_size})")
    if cfg.type_vocab_size < 0:
        _fail("type_vocab_size", cfg.type_vocab_size, "must be >= 0 (0 = no token types)")
    if cfg.arch != "decoder" and not cfg.causal:
        _fail("causal", cfg.causal, "only decoder-only models take causal=False (an ablation)")
    if cfg.arch == "encoder" and cfg.sliding_window is not None:
        _fail("sliding_window", cfg.sliding_window, "sliding windows are causal: decoders only")
