"""Typed, frozen, validated model configuration.

One ``ModelConfig`` describes all three architectures (``arch``): a decoder-only language
model, an encoder-only masked language model and the 2017 encoder-decoder. Every
architectural choice is a field, declared in its group (``attnlab.config.groups``: stack,
embedding, positions, attention, feedforward, norms, training, execution) and stored flat;
``validate`` (run on construction) rejects inconsistent values with a ``ValueError`` that
names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from attnlab.config import groups
from attnlab.config.architectures import architecture
from attnlab.config.checks import _derivations, _fail, rope_scaling_of, validate, validate_raw
from attnlab.config.groups import (
    AttentionConfig,
    EmbeddingConfig,
    ExecutionConfig,
    FFNConfig,
    NormConfig,
    PositionConfig,
    StackConfig,
    TrainingConfig,
)
from attnlab.config.layer_kinds import BlockPattern
from attnlab.contracts.ffn import make_ffn_settings
from attnlab.contracts.mixer import make_settings

# Beyond this many decoder layers, "auto" decoding scans: the unrolled loop body's compile
# time grows with depth (about 0.5 s a layer on a 2-core CPU) and stops paying for itself.
UNSTACKED_DECODE_MAX_LAYERS = 12


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one layer of ``ModelConfig.layer_pattern`` changes: its sliding window (None:
    global attention), its RoPE base (None: ``ModelConfig.rope_theta``) and whether it
    rotates at all (``rope=False``: a NoPE layer, no positions in its attention)."""

    window: int | None = None
    rope_theta: float | None = None
    rope: bool = True

    @classmethod
    def of(cls, value) -> LayerSpec:
        if isinstance(value, LayerSpec):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"window", "rope_theta", "rope"})
            if unknown:
                _fail(
                    "layer_pattern",
                    value,
                    f"unknown key(s) {unknown}: use window, rope_theta, rope",
                )
            return cls(**value)
        if value in ("global", None):
            return cls()
        _fail("layer_pattern", value, "list dicts {'window': W, 'rope_theta': R} or 'global'")


# The groups listed last to first: a dataclass takes its bases' fields in reverse order, so
# the fields run from the stack's to the execution's, as ``groups.GROUPS`` lists them.
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(
    ExecutionConfig,
    TrainingConfig,
    NormConfig,
    FFNConfig,
    AttentionConfig,
    PositionConfig,
    EmbeddingConfig,
    StackConfig,
):
    """All architectural choices of an attnlab model.

    The fields come in groups, one concept each (``attnlab.config.groups``), read flat
    (``cfg.n_heads``) or by group (``cfg.attention.n_heads``: an ``AttentionConfig``). A
    config may be built by group as well as flat: ``ModelConfig(attention=
    AttentionConfig(n_heads=8), d_model=256)`` equals ``ModelConfig(n_heads=8, d_model=256)``;
    a group (or a dict of its fields) sets all its fields, so naming one of them flat too
    is an error. ``replace`` takes groups too.

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
    ``"auto"`` takes the chunked path on CPU from 128 queries on (measured faster there),
    cuDNN on an NVIDIA GPU for plain causal 16-bit self-attention (``gpu_prefers_cudnn``),
    a fused kernel of ``attnlab.ops.flex`` where one is installed and covers the call (with
    a score function: the chunked path where none does), and XLA's fused path otherwise;
    ``"pallas_gpu"``, ``"pallas_tpu"``, ``"splash"`` and ``"tokamax"`` ask for a kernel
    (blocks as for ``"chunked"``), falling back, named under ``--verbose``, to the chunked
    path.

    ``decode_layers`` is how the generation loops (sampling, beam search) run the decoder:
    ``"unstacked"`` slices the stacked weights into separate blocks once per call and
    unrolls the layers in the loop body, so each token reads every weight where it lies
    (fastest per token; the program grows with depth); ``"scan"`` scans the stacked
    weights at every token (program flat in depth, but each step slices every layer's
    weights: on CPU, a copy); ``"auto"`` is ``"unstacked"`` up to
    ``UNSTACKED_DECODE_MAX_LAYERS`` decoder layers and ``"scan"`` beyond.

    ``block_pattern`` makes a hybrid stack: an optional prefix of layer kinds and a block
    of kinds repeated to fill ``n_layers``, each kind its own mixer(s) and FFN
    (``attnlab.config.layer_kinds``); None is the one-kind stack of ``mixer`` and ``ffn_variant``.

    ``context_parallel`` is how self-attention runs when the mesh splits the sequence
    (``mesh.context > 1``; see ``attnlab.ops.context_parallel``): ``"ring"`` passes
    key/value chunks round the devices, ``"all_gather"`` gathers them all on each device.
    ``context_load_balance`` gives causal stacks the zigzag layout under the ring, so every
    device does the same work. Neither changes anything on a mesh without a context axis.
    """

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
        if self.block_pattern is not None:
            object.__setattr__(self, "block_pattern", BlockPattern.of(self.block_pattern))
        if not isinstance(self.mixer, str):
            _fail("mixer", self.mixer, "name a registered mixer (attnlab.registered_mixers())")
        object.__setattr__(self, "mixer_settings", make_settings(self.mixer, self.mixer_settings))
        if not isinstance(self.ffn_variant, str):
            _fail(
                "ffn_variant", self.ffn_variant, "name a registered FFN (attnlab.registered_ffns())"
            )
        settings = make_ffn_settings(self.ffn_variant, self.ffn_settings)
        object.__setattr__(self, "ffn_settings", settings)
        object.__setattr__(self, "rope_scaling", rope_scaling_of(self.rope_scaling))
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
        return architecture(self).stack_layers(self)

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

    def layer_ropes(self, n_layers: int) -> tuple[tuple, ...]:
        """Each layer's ``(rope_theta, rope_scaling)``: ``rope_scaling`` scales the layers
        on the model's base; a layer with a base of its own (``layer_pattern``) rotates
        unscaled (Gemma 3's local layers); a NoPE layer (``rope=False``) is ``(None, None)``."""
        p = self.layer_pattern
        spec = lambda i: p[i % len(p)] if p is not None else LayerSpec()
        thetas = self.layer_rope_thetas(n_layers)
        return tuple(
            (None, None)
            if not spec(i).rope
            else (thetas[i], None if spec(i).rope_theta is not None else self.rope_scaling)
            for i in range(n_layers)
        )

    # Each group of fields as one value: ``cfg.attention`` is an ``AttentionConfig``.
    stack = groups.View(StackConfig)
    embedding = groups.View(EmbeddingConfig)
    positions = groups.View(PositionConfig)
    attention = groups.View(AttentionConfig)
    feedforward = groups.View(FFNConfig)
    norms = groups.View(NormConfig)
    training = groups.View(TrainingConfig)
    execution = groups.View(ExecutionConfig)

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``, flat fields or whole groups (``attention=...``); fields
        that were derived are derived again unless changed (a group's field left at the
        value it has counts as unchanged), and a new ``mixer`` takes its default settings
        unless ``mixer_settings`` is given."""
        flat, grouped = groups.spread(changes)
        changes = {k: v for k, v in grouped.items() if v != getattr(self, k)} | flat
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
        if self.rope_scaling is not None:
            scaling = dataclasses.asdict(self.rope_scaling)
            out["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v
                                   for k, v in scaling.items()}  # fmt: skip
        if self.block_pattern is not None:
            out["block_pattern"] = self.block_pattern.to_dict()
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """The config ``to_dict`` (or ``config.json``) wrote, or one with groups as dicts of
        their fields (``{"attention": {"n_heads": 8}, ...}``); an unknown key is an error."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - names - groups.GROUPS.keys())
        if unknown:
            raise ValueError(
                f"ModelConfig has no field(s) {unknown}; valid fields are {sorted(names)} "
                f"and the groups {list(groups.GROUPS)}"
            )
        return cls(**values)


def _taking_groups(flat_init):
    """``ModelConfig``'s dataclass ``__init__``, taking groups as well as fields."""

    @functools.wraps(flat_init)
    def __init__(self, **values):
        flat, grouped = groups.spread(values)
        flat_init(self, **grouped, **flat)

    return __init__


ModelConfig.__init__ = _taking_groups(ModelConfig.__init__)
