"""A stack of blocks: positions, the shared mask and bias, the layers scanned or unrolled.

A ``Stack`` owns what is per-stack: absolute or relative positions, an optional embedding
norm, the blocks (``attnlab.nn.blocks``) and an optional final norm; it describes the mask
and the position bias once (``ops.MaskSpec``, ``ops.PositionBias``: the only mask type;
attention resolves it, block by block on the chunked path, so no ``[T, S]`` array is built
there) and shares them across its blocks.

Layers are a stack: the ``L`` blocks are one ``Block`` whose parameters carry a leading
layer axis (``layers.attn.q_DNH`` is ``[L, D, N, H]``), applied by ``lax.scan`` so the
traced program does not grow with depth (``ModelConfig.scan_layers=False`` unrolls the
same parameters in a Python loop). What differs between layers is data inside the scan:
the layer index (dropout keys, the cache layer to write), each layer's sliding window and
RoPE base (``ModelConfig.layer_pattern``), the cross-attention keys/values. The cache's
entries (``KVCache.layers``, whatever the variant declared) are carried through the scan
and written in place; ``ModelConfig.remat`` rematerialises each layer in the backward pass.
One call is the same code in every mode: training (no cache), prefill and a decode step
(a cache, linear or a ring); ``Stack._self_attention`` is the one place the modes differ.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import kv_cache, ops
from attnlab.config import ModelConfig
from attnlab.ffns import get_ffn
from attnlab.kv_cache import KVCache, LayerCache, Ring
from attnlab.mixers import MixerCall
from attnlab.nn import context_parallel
from attnlab.nn.blocks import Block, stacked
from attnlab.nn.layers import LearnedPositions, Norm, RelativeBias
from attnlab.ops.linear import dropout, fold
from attnlab.sharding import constrain

NO_WINDOW = jnp.iinfo(jnp.int32).max  # a layer's window when it attends to everything
REMAT_POLICIES = {
    "full": None,  # save nothing but the layer's inputs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the weight matmuls
}


def _unstacked(layers, n: int):
    """``n`` separate blocks sliced from a stacked one."""
    graphdef, params = nnx.split(layers)
    return nnx.List(
        [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], params)) for i in range(n)]
    )


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
        # A prefix of layers with the plain FFN (an FFN variant's ``prefix_layers``, such as
        # DeepSeek's dense first layers): a stack of its own, scanned before the others.
        self.n_prefix = get_ffn(cfg.ffn_variant).prefix_layers(cfg, cfg.ffn_settings)
        dense = lambda r: Block(cfg, cross=cross, dense_ffn=True, rngs=r)
        self.prefix = stacked(dense, self.n_prefix, rngs) if self.n_prefix else None
        block = lambda r: Block(cfg, cross=cross, rngs=r)
        self.layers = stacked(block, n_layers - self.n_prefix, rngs)
        self.final_norm = Norm(cfg, cfg.d_model, rngs=rngs) if cfg.final_norm else None
        # Static per-layer data: each layer's window (None: full attention) and RoPE base.
        self.windows = cfg.layer_windows(n_layers) if causal else (None,) * n_layers
        self.rope_thetas = cfg.layer_rope_thetas(n_layers)
        self.ropes = cfg.layer_ropes(n_layers)
        # With a scaling on some layers, each layer picks its (base, scaling) by index.
        scaled = any(scaling is not None for _, scaling in self.ropes)
        self.rope_options = tuple(dict.fromkeys(self.ropes)) if scaled else None

    def unstack(self):
        """Holds the layers as ``L`` separate blocks (sliced from the stacked parameters).

        For loops that run the model many times over the same weights, such as decoding:
        a scan over stacked parameters slices (on CPU: copies) every layer's weights at
        every call, while separate blocks are read where they lie. The stack then runs its
        layers unrolled, so the traced program grows with depth again.
        """
        if isinstance(self.layers, nnx.List):
            return
        self.layers = _unstacked(self.layers, self.n_layers - self.n_prefix)
        if self.prefix is not None:
            self.prefix = _unstacked(self.prefix, self.n_prefix)

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
        if self.positions is not None:
            x_BTD = x_BTD + self.positions(positions_BT).astype(x_BTD.dtype)
        elif cfg.position == "sinusoidal":
            table = ops.sinusoidal(cfg.max_len, cfg.d_model, layout=cfg.sinusoidal_layout)
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
    ):
        """Runs the stack over ``x``.

        ``cache``: a ``KVCache`` whose entries this call's tokens are appended to, after
        each row's ``lengths`` (``valid_BS`` then marks each row's real new tokens, a
        right-padded prefix); its ``cross`` entries are the encoder output's keys and values
        (or pass ``enc_BSD``). Returns ``(x_BTD, cache | None, weights, aux)``: the cache
        with the written entries and the lengths advanced, the weights a tuple of per-layer
        dicts when asked for, the FFN's report (``aux``) or None.
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
        layer = self._layer(shared, enc_BSD, key, return_weights)
        entries = None if cache is None else cache.layers
        x_BTD, entries, (weights, aux) = self._over_layers(
            layer, x_BTD, entries, self._per_layer_data(cache)
        )
        if context is not None:
            x_BTD = context.leave(x_BTD)
        if self.final_norm is not None:
            x_BTD = self.final_norm(x_BTD)
        if return_weights:
            unstack = lambda i: jax.tree.map(lambda w: w[i], weights)
            weights = tuple(unstack(i) for i in range(self.n_layers))
        if cache is not None:
            cache = cache.replace(layers=entries, lengths=cache.lengths + shared.count_B)
        return x_BTD, cache, weights, _total_aux(aux)

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

    def _per_layer_data(self, cache):
        """The scan's data beside the parameters: index, window, RoPE base, cross K/V."""
        window_L = jnp.array([NO_WINDOW if w is None else w for w in self.windows], jnp.int32)
        thetas = set(self.rope_thetas)
        rope_L = jnp.array(self.rope_thetas, jnp.float32) if len(thetas) > 1 else None
        if self.rope_options is not None:  # indices into the (base, scaling) options
            index = [self.rope_options.index(r) for r in self.ropes]
            rope_L = jnp.array(index, jnp.int32) if len(self.rope_options) > 1 else None
        cross_kv = None
        if cache is not None and cache.cross is not None:
            cross_kv = (cache.cross["keys"], cache.cross["values"])
        index_L = jnp.arange(self.n_layers, dtype=jnp.int32)
        return (index_L, window_L, rope_L, cross_kv)

    def _layer_rope(self, per_layer):
        """What a layer's mixer gets as ``MixerCall.rope_theta`` from its per-layer datum."""
        if self.rope_options is not None:
            return ops.RopeChoice(0 if per_layer is None else per_layer, self.rope_options)
        return self.rope_thetas[0] if per_layer is None else per_layer

    def _layer(self, s: _Shared, enc_BSD, key, return_weights):
        """One layer as a function of ``(graphdef, (x, entries), per-layer data)``, the
        remat policy applied: the body of the scan (or of the unrolled loop)."""
        cache = s.cache
        split = cache is not None and cache.split

        def layer(graphdef, carry, xs):
            x_BTD, entries = carry
            params, index, window, theta, cross_kv = xs
            block = nnx.merge(graphdef, params)
            layer_mask = s.mask.with_window(window) if s.context else s.mask
            if s.per_layer_window:
                layer_mask = s.mask.replace(window=window)
            view = None
            if entries is not None:
                # A layer's own cache arrays (a split cache) hold it at index 0.
                slot = 0 if split else index
                view = LayerCache(entries, slot, cache.lengths, s.count_B, s.ring, cache.slot_axes)
            call = MixerCall(
                positions_BT=s.positions_BT,
                mask=layer_mask,
                bias=s.bias,
                rope_theta=self._layer_rope(theta),
                cache=view,
                key=fold(key, index),
                layer=index,
                return_weights=return_weights,
            )
            if cross_kv is not None:
                cross_kv = tuple(jnp.swapaxes(c, 1, 2) for c in cross_kv)  # [B, S, K, H]
            x_BTD, view, weights, aux = block(
                x_BTD, call, enc_BSD=enc_BSD, cross_mask=s.cross_mask, cross_kv=cross_kv
            )
            x_BTD = constrain(x_BTD, "batch", "length", "act_embed")  # the residual stream
            return (x_BTD, None if view is None else view.layers), (weights, aux)

        if self.cfg.remat == "none":
            return layer
        return jax.checkpoint(
            layer,
            policy=REMAT_POLICIES[self.cfg.remat],
            prevent_cse=not self.cfg.scan_layers,
            static_argnums=(0,),
        )

    def _over_layers(self, layer, x_BTD, entries, per_layer_data):
        """Applies the prefix layers (if any), then the others; the outputs of both
        (per-layer weights, the FFN's ``aux``) are joined along the layer axis."""
        k = self.n_prefix
        if self.prefix is None:
            return self._over_group(layer, self.layers, x_BTD, entries, per_layer_data)
        split = entries is not None and isinstance(next(iter(entries.values())), tuple)
        part = lambda e, s: {n: a[s] for n, a in e.items()} if split else e
        head = jax.tree.map(lambda a: a[:k], per_layer_data)
        tail = jax.tree.map(lambda a: a[k:], per_layer_data)
        x_BTD, first, (w0, _) = self._over_group(
            layer, self.prefix, x_BTD, part(entries, slice(None, k)), head
        )
        # The second group writes on after the first: its slice of a split cache, or the
        # whole cache the prefix wrote (layers write at their own index).
        x_BTD, rest, (w1, aux) = self._over_group(
            layer, self.layers, x_BTD, part(entries if split else first, slice(k, None)), tail
        )
        if split:
            rest = {n: first[n] + rest[n] for n in rest}
        weights = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), w0, w1)
        return x_BTD, rest, (weights, aux)

    def _over_group(self, layer, layers, x_BTD, entries, per_layer_data):
        """Applies ``layer`` to every layer: scanned over the stacked parameters, or unrolled
        (``scan_layers=False``, separate blocks). The cache entries are carried through, and
        a split cache (one array per layer) is written layer by layer where it lies."""
        split = entries is not None and isinstance(next(iter(entries.values())), tuple)
        n_layers = len(jax.tree.leaves(per_layer_data)[0])
        if isinstance(layers, nnx.List):  # separate blocks (see ``unstack``)
            params, layer_params = None, [nnx.state(block) for block in layers]
            layer = functools.partial(layer, nnx.graphdef(layers[0]))
        else:
            params, layer_params = nnx.state(layers), None
            layer = functools.partial(layer, nnx.graphdef(layers))
        if layer_params is None and self.cfg.scan_layers:
            if split:  # the scan needs the layers stacked again
                entries = {n: jnp.concatenate(a) for n, a in entries.items()}
            (x_BTD, entries), weights = jax.lax.scan(
                layer, (x_BTD, entries), (params,) + per_layer_data
            )
            if split:
                entries = {n: kv_cache.layer_arrays(a) for n, a in entries.items()}
            return x_BTD, entries, weights
        per_layer, written = [], []
        for i in range(n_layers):
            data = jax.tree.map(lambda a, i=i: a[i], per_layer_data)
            p = layer_params[i] if params is None else jax.tree.map(lambda a, i=i: a[i], params)
            layer_entries = {n: a[i] for n, a in entries.items()} if split else entries
            (x_BTD, layer_entries), w = layer((x_BTD, layer_entries), (p,) + data)
            if split:
                written.append(layer_entries)
            else:
                entries = layer_entries
            per_layer.append(w)
        if split:
            entries = {n: tuple(w[n] for w in written) for n in entries}
        return x_BTD, entries, jax.tree.map(lambda *ws: jnp.stack(ws), *per_layer)
