"""A stack of blocks: positions, the shared mask and bias, the layers scanned or unrolled.

A ``Stack`` owns what is per-stack: absolute or relative positions, an optional embedding
norm, the blocks (``attnlab.nn.blocks``) and an optional final norm; it describes the mask
and the position bias once (``ops.MaskSpec``, ``ops.PositionBias``: the only mask type;
attention resolves it, block by block on the chunked path, so no ``[T, S]`` array is built
there) and shares them across its blocks.

Layers are a stack: the layers are segments (``attnlab.config.layer_kinds``: a homogeneous stack
is one, after the FFN variant's dense prefix if any; a hybrid stack is an optional prefix
and a block of layer kinds repeated), each one unit (a ``Block``, or a ``Period`` of the P
blocks of a hybrid block) whose parameters carry a leading repeat axis
(``layers.attn.q_DNH`` is ``[L, D, N, H]``; ``layers.blocks.3.attn.q_DNH`` is
``[R, D, N, H]``), applied by ``lax.scan`` (``attnlab.nn.segments``) so the traced program
does not grow with depth (``ModelConfig.scan_layers=False`` unrolls the same parameters in a
Python loop). What differs between layers is data inside the scan: the layer index
(dropout keys), each layer's sliding window and RoPE base (``ModelConfig.layer_pattern``),
the cross-attention keys/values, each mixer's place in the cache. The cache's entries
(``KVCache.layers``, whatever the variants declared) are carried through the scan and
written in place; ``ModelConfig.remat`` rematerialises each unit in the backward pass.
One call is the same code in every mode: training (no cache), prefill and a decode step
(a cache, linear or a ring); ``Stack._self_attention`` is the one place the modes differ.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab import ops
from attnlab.config import ModelConfig
from attnlab.config.layer_kinds import StackPlan, stack_plan
from attnlab.errors import DecodeError, traced_check
from attnlab.kv_cache import KVCache, Ring
from attnlab.nn import context_parallel, segments
from attnlab.nn.blocks import stacked
from attnlab.nn.layers import LearnedPositions, Norm, RelativeBias
from attnlab.nn.segments import NO_WINDOW, REMAT_POLICIES  # noqa: F401 - read from here too
from attnlab.ops.linear import dropout, fold
from attnlab.ops.precision import wide


def _total_aux(aux):
    """The FFN reports of every layer (stacked on a leading layer axis) with ``loss``
    summed over the layers; None when the FFN reports nothing."""
    if not aux:
        return None
    return {**aux, "loss": jnp.sum(aux["loss"])}


@dataclasses.dataclass(frozen=True)
class _Shared:
    """What the layers of one stack call share (``Stack._shared``)."""

    positions_BT: Any
    mask: ops.MaskSpec
    bias: Any
    ring: Ring | None
    per_layer_window: bool  # each layer's window from the scan's data
    context: bool  # the sequence is split over the mesh's context axis
    cross_mask: ops.MaskSpec | None
    cache: KVCache | None
    count_B: Any  # each row's new tokens (with a cache)


def check_positions(positions_BT, cfg: ModelConfig) -> None:
    """Raises a ``DecodeError`` for concrete positions outside an absolute position table
    (``max_len`` rows), where the lookup would give NaN. Traced positions are a ``checkify``
    check inside ``attnlab.decode.checks.checked_jit`` (``attnlab.errors.traced_check``)
    and give NaN logits elsewhere."""
    if isinstance(positions_BT, jax.core.Tracer):
        low, high = lambda: jnp.min(positions_BT), lambda: jnp.max(positions_BT)
        traced_check(
            lambda: (low() >= -cfg.position_offset) & (high() < cfg.max_len),
            f"positions {{low}} to {{high}} reach outside the table of ModelConfig.max_len="
            f"{cfg.max_len} positions (position={cfg.position!r}): feed at most max_len "
            "tokens per row, or build a model with a larger max_len",
            low=low,
            high=high,
        )
        return
    p_BT = np.asarray(positions_BT)
    bad_BT = (p_BT < -cfg.position_offset) | (p_BT >= cfg.max_len)
    if bad_BT.any():
        b, t = (int(i) for i in np.argwhere(bad_BT)[0])
        raise DecodeError(
            f"position {int(p_BT[b, t])} (row {b}, token {t}) is outside the table of "
            f"ModelConfig.max_len={cfg.max_len} positions (position={cfg.position!r}): feed "
            "at most max_len tokens per row, or build a model with a larger max_len"
        )


class Stack(nnx.Module):
    """Positions + a stack of blocks + final norm over embedded tokens (encoder or decoder)."""

    def __init__(
        self, cfg: ModelConfig, n_layers: int, *, causal: bool, cross: bool, rngs: nnx.Rngs
    ):
        self.cfg = cfg
        self.causal = causal
        self.n_layers = n_layers
        self.positions = LearnedPositions(cfg, rngs=rngs) if cfg.position == "learned" else None
        self.relative = (
            RelativeBias(cfg, bidirectional=not causal, rngs=rngs)
            if cfg.position == "relative"
            else None
        )
        self.embed_norm = Norm(cfg, cfg.d_model, rngs=rngs) if cfg.embedding_norm else None
        # The segments: ``prefix`` (DeepSeek's dense first layers, a hybrid's prefix; None
        # without), then ``layers``, each its units stacked over its repeats.
        units = {
            s.attr: stacked(segments.unit(cfg, s, cross), s.repeats, rngs)
            for s in self.plan.segments
        }
        self.prefix = units.get("prefix")
        self.layers = units["layers"]
        self.final_norm = Norm(cfg, cfg.d_model, rngs=rngs) if cfg.final_norm else None
        # Static per-layer data: each layer's window (None: full attention) and RoPE base.
        self.windows = cfg.layer_windows(n_layers) if causal else (None,) * n_layers
        self.rope_thetas = cfg.layer_rope_thetas(n_layers)
        self.ropes = cfg.layer_ropes(n_layers)  # (base, scaling) per layer

    @property
    def plan(self) -> StackPlan:
        """The stack's segments and cache groups (``attnlab.config.layer_kinds``)."""
        return stack_plan(self.cfg, self.n_layers)

    def unstack(self):
        """Holds the layers as separate units (sliced from the stacked parameters).

        For loops that run the model many times over the same weights, such as decoding:
        a scan over stacked parameters slices (on CPU: copies) every layer's weights at
        every call, while separate blocks are read where they lie. The stack then runs its
        layers unrolled, so the traced program grows with depth again (a hybrid's units
        are its block's repeats, each ``Period`` holding the block's layers).
        """
        for segment in self.plan.segments:
            layers = getattr(self, segment.attr)
            if not isinstance(layers, nnx.List):
                setattr(self, segment.attr, segments.unstacked(layers, segment.repeats))

    def _bias(self, q_positions_BT, k_positions_BS):
        """The position bias as a description (``ops.PositionBias``), or None."""
        if self.relative is not None:
            return self.relative.describe(q_positions_BT, k_positions_BS)
        if self.cfg.position == "alibi":
            slopes_N = ops.alibi_slopes(self.cfg.n_heads)
            return ops.PositionBias.alibi(slopes_N, q_positions_BT, k_positions_BS)
        return None

    def embed_positions(self, x_BTD, positions_BT):
        cfg = self.cfg
        if self.positions is not None or cfg.position == "sinusoidal":
            check_positions(positions_BT, cfg)
        if self.positions is not None:
            x_BTD = x_BTD + self.positions(positions_BT).astype(x_BTD.dtype)
        elif cfg.position == "sinusoidal":
            table = ops.sinusoidal(
                cfg.max_len, cfg.d_model, layout=cfg.sinusoidal_layout, dtype=wide(x_BTD)
            )
            x_BTD = x_BTD + jnp.take(table, positions_BT, axis=0).astype(x_BTD.dtype)
        if self.embed_norm is not None:
            x_BTD = self.embed_norm(x_BTD)
        return x_BTD

    def _self_attention(self, T, positions_BT, valid_BS, segment_ids_BT, cache, count_B):
        """``(mask, bias, ring, per_layer_window)`` of one call's self-attention: the one
        place its mask is described (a sequence, a linear cache or a ring buffer)."""
        ring = None
        if cache is None:
            k_positions_BS = positions_BT
            mask = ops.MaskSpec.for_sequence(
                T, causal=self.causal, segment_ids=segment_ids_BT, k_valid=valid_BS
            )
        elif cache.ring:  # keys at a ring's slot positions, its own mask
            ring = Ring(cache.lengths, count_B, cache.window)
            k_positions_BS, mask = ring.keys(T, self.windows)
        else:
            B, S = positions_BT.shape[0], cache.capacity
            k_positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (B, S))
            mask = ops.MaskSpec.for_cache(T, S, cache.lengths, causal=self.causal)
        windows = set(self.windows)
        per_layer_window = len(windows) > 1
        if len(windows) == 1 and None not in windows and ring is None:
            mask = mask.replace(window=jnp.asarray(min(windows), jnp.int32))
        return mask, self._bias(positions_BT, k_positions_BS), ring, per_layer_window

    def __call__(
        self,
        x_BTD,
        *,
        positions_BT,
        valid_BS=None,
        segment_ids_BT=None,
        enc_BSD=None,
        enc_valid_BS=None,
        cache: KVCache | None = None,
        key=None,
        return_weights=False,
        collect=(),
    ):
        """Runs the stack over ``x``.

        ``cache``: a ``KVCache`` whose entries this call's tokens are appended to, after
        each row's ``lengths`` (``valid_BS`` then marks each row's real new tokens, a
        right-padded prefix); its ``cross`` entries are the encoder output's keys and values
        (or pass ``enc_BSD``). Returns ``(x_BTD, cache | None, weights, aux, stats)``: the cache
        with the written entries and the lengths advanced, the weights a tuple of per-layer
        dicts when asked for, the FFN's report (``aux``) or None, and the named per-layer
        statistics asked for in ``collect`` (``segments.COLLECTABLE``: ``{"attention":
        {"max_logit": [L], ...}, "residual": {...}}``, each layer's reduced inside it) or
        None.
        """
        T = x_BTD.shape[1]
        x_BTD = dropout(
            self.embed_positions(x_BTD, positions_BT), self.cfg.dropout, fold(key, 1_000_000)
        )
        context = context_parallel.plan(
            self, T, cached=cache is not None, return_weights=return_weights
        )
        if context is not None:  # the sequence split over the mesh's context axis
            x_BTD, positions_BT, valid_BS, segment_ids_BT = context.enter(
                x_BTD, positions_BT, valid_BS, segment_ids_BT
            )
        shared = self._shared(T, positions_BT, valid_BS, segment_ids_BT, enc_valid_BS, cache,
                              context)  # fmt: skip
        run = segments.Layers(self.cfg, self.plan, shared, self.rope_thetas, self.ropes,
                              self.windows, enc_BSD, key, return_weights,
                              tuple(collect))  # fmt: skip
        entries = None if cache is None else cache.layers
        weights = aux = stats = None
        for segment in self.plan.segments:
            x_BTD, entries, (w, a, s) = run.run(
                segment, getattr(self, segment.attr), x_BTD, entries, cache
            )
            weights = segments.join(weights, segments.flat_layers(w))
            aux = segments.join(aux, segments.flat_layers(a))
            stats = segments.join(stats, segments.flat_layers(s))
        if context is not None:
            x_BTD = context.leave(x_BTD)
        if self.final_norm is not None:
            x_BTD = self.final_norm(x_BTD)
        if return_weights:
            unstack = lambda i: jax.tree.map(lambda w: w[i], weights)
            weights = tuple(unstack(i) for i in range(self.n_layers))
        if cache is not None:
            cache = cache.replace(layers=entries, lengths=cache.lengths + shared.count_B)
        return x_BTD, cache, weights, _total_aux(aux), stats

    def _shared(self, T, positions_BT, valid_BS, segment_ids_BT, enc_valid_BS, cache, context):
        """What every layer of one call shares: the masks, the bias, the cache's view."""
        count_B = None
        if cache is not None:  # each row's new tokens
            B = positions_BT.shape[0]
            count_B = (
                jnp.full((B,), T, jnp.int32)
                if valid_BS is None
                else jnp.sum(valid_BS, axis=1, dtype=jnp.int32)
            )
        mask, bias, ring, per_layer_window = self._self_attention(
            T, positions_BT, valid_BS, segment_ids_BT, cache, count_B
        )
        if context is not None:  # described per chunk
            mask, bias = context.describe(self, positions_BT, valid_BS, segment_ids_BT), None
            per_layer_window = False
        cross_mask = None
        if enc_valid_BS is not None:
            cross_mask = ops.MaskSpec.for_sequence(T, enc_valid_BS.shape[1], k_valid=enc_valid_BS)
        return _Shared(positions_BT, mask, bias, ring, per_layer_window, context is not None,
                       cross_mask, cache, count_B)  # fmt: skip
