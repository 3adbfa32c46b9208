"""Transformer blocks and stacks of them.

A ``Block`` is self-attention, optional cross-attention and a feed-forward network, each a
residual sub-layer in pre-norm (``x + f(norm(x))``) or post-norm (``norm(x + f(x))``)
placement. A ``Stack`` owns what is per-stack: absolute or relative positions, an optional
embedding norm, the blocks and an optional final norm; it builds the masks and position
biases once and shares them across its blocks. With ``attention_impl="chunked"`` these are
descriptions (``ops.MaskSpec``, ``ops.PositionBias``) that attention evaluates block by
block, so no ``[T, S]`` array is built anywhere in the stack; other implementations get
dense arrays.

Layers are a stack: the ``L`` blocks are one ``Block`` whose parameters carry a leading
layer axis (``layers.attn.q_DNH`` is ``[L, D, N, H]``), applied by ``lax.scan`` so the
traced program does not grow with depth (``ModelConfig.scan_layers=False`` unrolls the
same parameters in a Python loop). What differs between layers is data inside the scan:
the layer index (dropout keys, the cache layer to write), each layer's sliding window, the
cross-attention keys/values. The KV cache is carried through the scan and written in
place; ``ModelConfig.remat`` rematerialises each layer in the backward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import kv_cache, ops
from attnlab.config import ModelConfig
from attnlab.nn import context_parallel
from attnlab.nn.attention import Attention
from attnlab.nn.layers import FeedForward, LearnedPositions, Norm, RelativeBias
from attnlab.ops.attention import cpu_prefers_chunked
from attnlab.ops.linear import dropout, fold
from attnlab.sharding import constrain

NO_WINDOW = jnp.iinfo(jnp.int32).max  # a layer's window when it attends to everything
REMAT_POLICIES = {
    "full": None,  # save nothing but the layer's inputs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the weight matmuls
}


def stacked(make, n: int, rngs: nnx.Rngs):
    """``n`` modules ``make(rngs)`` as one module whose parameters have a leading axis."""
    keys = jax.random.split(rngs.params(), n)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    state = jax.vmap(lambda key: nnx.state(make(nnx.Rngs(params=key))))(keys)
    return nnx.merge(graphdef, state)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, cross: bool = False, rngs: nnx.Rngs):
        D = cfg.d_model
        self.pre_norm = cfg.norm_placement == "pre"
        self.rate = cfg.dropout
        self.attn_norm = Norm(cfg, D, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.cross_norm = Norm(cfg, D, rngs=rngs) if cross else None
        self.cross_attn = Attention(cfg, cross=True, rngs=rngs) if cross else None
        self.ffn_norm = Norm(cfg, D, rngs=rngs)
        self.ffn = FeedForward(cfg, rngs=rngs)

    def _residual(self, x, norm, fn, key):
        if self.pre_norm:
            y, *rest = fn(norm(x))
            return x + dropout(y, self.rate, key), rest
        y, *rest = fn(x)
        return norm(x + dropout(y, self.rate, key)), rest

    def __call__(
        self,
        x_BTD,
        *,
        positions_BT,
        mask,
        bias=None,
        enc_BSD=None,
        cross_mask=None,
        cache=None,
        cross_cache=None,
        key=None,
        return_weights=False,
    ):
        """Returns ``(x_BTD, cache, weights)``; ``weights`` is a dict or None."""
        x_BTD, (cache, w_self) = self._residual(
            x_BTD,
            self.attn_norm,
            lambda h: self.attn(
                h,
                positions_BT=positions_BT,
                mask=mask,
                bias=bias,
                cache=cache,
                key=fold(key, 0),
                return_weights=return_weights,
            ),
            fold(key, 1),
        )
        weights = {"self": w_self} if return_weights else None
        if self.cross_attn is not None:
            x_BTD, (_, w_cross) = self._residual(
                x_BTD,
                self.cross_norm,
                lambda h: self.cross_attn(
                    h,
                    mask=cross_mask,
                    kv_BSD=enc_BSD,
                    cache=cross_cache,
                    key=fold(key, 2),
                    return_weights=return_weights,
                ),
                fold(key, 3),
            )
            if return_weights:
                weights["cross"] = w_cross
        x_BTD, _ = self._residual(
            x_BTD, self.ffn_norm, lambda h: (self.ffn(h, key=fold(key, 4)),), fold(key, 5)
        )
        return x_BTD, cache, weights


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
        self.layers = stacked(lambda r: Block(cfg, cross=cross, rngs=r), n_layers, rngs)
        self.final_norm = Norm(cfg, cfg.d_model, rngs=rngs) if cfg.final_norm else None
        # Static per-layer data: each layer's window (None: full attention).
        self.windows = cfg.layer_windows(n_layers) if causal else (None,) * n_layers

    def unstack(self):
        """Holds the layers as ``L`` separate blocks (sliced from the stacked parameters).

        For loops that run the model many times over the same weights, such as decoding:
        a scan over stacked parameters slices (on CPU: copies) every layer's weights at
        every call, while separate blocks are read where they lie. The stack then runs its
        layers unrolled, so the traced program grows with depth again.
        """
        if isinstance(self.layers, nnx.List):
            return
        graphdef, params = nnx.split(self.layers)
        self.layers = nnx.List(
            [
                nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], params))
                for i in range(self.n_layers)
            ]
        )

    def chunked(self, T: int) -> bool:
        """Whether masks and biases reach attention as descriptions (evaluated per block): with
        ``attention_impl="chunked"``, and with ``"auto"`` for the built-in softmax where it
        runs blockwise (variants receive descriptions with "chunked" alone)."""
        if self.cfg.attention_impl == "auto" and self.cfg.attention_fn == "softmax":
            return cpu_prefers_chunked(T)
        return self.cfg.attention_impl == "chunked"

    def _self_mask(self, T, S, positions_BT, valid_BS, segment_ids_BT, cache_start_B):
        if self.chunked(T):
            if cache_start_B is not None:
                return ops.MaskSpec.for_cache(T, S, cache_start_B, causal=self.causal)
            return ops.MaskSpec.for_sequence(
                T, causal=self.causal, segment_ids=segment_ids_BT, k_valid=valid_BS
            )
        offset = 0 if cache_start_B is None else cache_start_B
        causal = ops.causal(T, S, offset=offset) if self.causal else None
        if cache_start_B is not None:
            # Keys past what has been written are invalid even without a causal mask.
            written = ops.lengths_to_valid(cache_start_B + T, S)
            return ops.combine(causal, ops.padding(k_valid_BS=written))
        segments = None if segment_ids_BT is None else ops.segment(segment_ids_BT)
        return ops.combine(causal, ops.padding(k_valid_BS=valid_BS), segments)

    def _bias(self, q_positions_BT, k_positions_BS):
        if self.relative is not None:
            if self.chunked(q_positions_BT.shape[1]):
                return self.relative.describe(q_positions_BT, k_positions_BS)
            return self.relative(q_positions_BT, k_positions_BS)
        if self.cfg.position == "alibi":
            slopes_N = ops.alibi_slopes(self.cfg.n_heads)
            if self.chunked(q_positions_BT.shape[1]):
                return ops.PositionBias.alibi(slopes_N, q_positions_BT, k_positions_BS)
            return ops.alibi_bias(slopes_N, q_positions_BT, k_positions_BS)
        return None

    def _with_window(self, mask, T, S, window, offset):
        if self.chunked(T):
            return mask.replace(window=jnp.asarray(window, jnp.int32))
        return ops.combine(mask, ops.sliding_window(T, S, window=window, offset=offset))

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

    def __call__(
        self,
        x_BTD,
        *,
        positions_BT,
        valid_BS=None,
        segment_ids_BT=None,
        enc_BSD=None,
        enc_valid_BS=None,
        cache=None,
        cross_cache=None,
        cache_start_B=None,
        ring=None,
        key=None,
        return_weights=False,
    ):
        """Runs the stack over ``x``.

        ``cache``: ``(k_LBKSH, v_LBKSH)`` to append this call's keys/values to, at
        ``cache_start_B``, or by ``ring`` (a ``kv_cache.Ring``) when the cache is a ring
        buffer; ``cross_cache``: ``(k_LBKSH, v_LBKSH)`` of the encoder output.
        Returns ``(x_BTD, (k_LBKSH, v_LBKSH) | None, weights)``, with ``weights`` a tuple of
        per-layer dicts when asked for.
        """
        B, T, _ = x_BTD.shape
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
        split = cache is not None and isinstance(cache[0], tuple)  # kv_cache.split_layers
        if cache is not None:
            S = (cache[0][0] if split else cache[0]).shape[3]  # [L, B, K, S, H]
            k_positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (B, S))
        else:
            S, k_positions_BS = T, positions_BT
        mask = self._self_mask(T, S, positions_BT, valid_BS, segment_ids_BT, cache_start_B)
        if ring is not None:  # keys at a ring's slot positions, its own mask (kv_cache.Ring)
            k_positions_BS, mask = ring.keys(T, self.windows)
        bias = self._bias(positions_BT, k_positions_BS)
        if enc_valid_BS is None:
            cross_mask = None
        elif self.chunked(T):
            cross_mask = ops.MaskSpec.for_sequence(T, enc_valid_BS.shape[1], k_valid=enc_valid_BS)
        else:
            cross_mask = ops.padding(k_valid_BS=enc_valid_BS)

        # Windows are static; a stack where they differ between layers builds each layer's
        # window mask inside the scan from the layer's window (per-layer data).
        windows = set(self.windows)
        window_L = jnp.array([NO_WINDOW if w is None else w for w in self.windows], jnp.int32)
        offset = 0 if cache_start_B is None else cache_start_B
        if len(windows) == 1 and None not in windows and ring is None:
            mask = self._with_window(mask, T, S, min(windows), offset)
        per_layer_window = len(windows) > 1
        if context is not None:  # described per chunk: the dense masks above go unused
            mask, bias = context.describe(self, positions_BT, valid_BS, segment_ids_BT), None
            per_layer_window = False

        def layer(carry, xs):
            x_BTD, kv = carry
            params, index, window, cross_kv = xs
            block = nnx.merge(graphdef, params)
            layer_mask = mask if context is None else mask.with_window(window)
            if per_layer_window:
                layer_mask = self._with_window(mask, T, S, window, offset)
            # A layer's own cache array (a split cache) holds it at index 0.
            slot = index if kv is None or kv[0].shape[0] > 1 else 0
            view = None if kv is None else kv_cache.LayerView(*kv, slot, cache_start_B, ring)
            x_BTD, view, weights = block(
                x_BTD,
                positions_BT=positions_BT,
                mask=layer_mask,
                bias=bias,
                enc_BSD=enc_BSD,
                cross_mask=cross_mask,
                cache=view,
                cross_cache=cross_kv,
                key=fold(key, index),
                return_weights=return_weights,
            )
            x_BTD = constrain(x_BTD, "batch", "length", "act_embed")  # the residual stream
            return (x_BTD, None if view is None else (view.k, view.v)), weights

        if self.cfg.remat != "none":
            policy = REMAT_POLICIES[self.cfg.remat]
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=not self.cfg.scan_layers)

        if cross_cache is not None:
            cross_cache = tuple(jnp.swapaxes(c, 2, 3) for c in cross_cache)  # [L, B, S, K, H]
        per_layer_data = (jnp.arange(self.n_layers, dtype=jnp.int32), window_L, cross_cache)
        carry = (x_BTD, None if cache is None else tuple(cache))
        if isinstance(self.layers, nnx.List):  # separate blocks (see ``unstack``)
            graphdef = nnx.graphdef(self.layers[0])
            layer_params = [nnx.state(block) for block in self.layers]
        else:
            graphdef, params = nnx.split(self.layers)
            layer_params = None
        if layer_params is None and self.cfg.scan_layers:
            if split:  # the scan needs the layers stacked again
                carry = (x_BTD, tuple(jnp.concatenate(c) for c in cache))
            carry, weights = jax.lax.scan(layer, carry, (params,) + per_layer_data)
            if split:
                carry = (carry[0], tuple(kv_cache.layer_arrays(c) for c in carry[1]))
        else:
            per_layer, written = [], []
            for i in range(self.n_layers):
                data = jax.tree.map(lambda a, i=i: a[i], per_layer_data)
                p = jax.tree.map(lambda a, i=i: a[i], params) if layer_params is None else None
                if split:
                    carry = (carry[0], (cache[0][i], cache[1][i]))
                carry, w = layer(carry, (p if p is not None else layer_params[i],) + data)
                written.append(carry[1])
                per_layer.append(w)
            if split:
                carry = (carry[0], tuple(zip(*written, strict=True)))
            weights = jax.tree.map(lambda *ws: jnp.stack(ws), *per_layer)
        x_BTD, new_cache = carry
        if context is not None:
            x_BTD = context.leave(x_BTD)
        if self.final_norm is not None:
            x_BTD = self.final_norm(x_BTD)
        if return_weights:
            unstack = lambda i: jax.tree.map(lambda w: w[i], weights)
            weights = tuple(unstack(i) for i in range(self.n_layers))
        return x_BTD, new_cache, weights
