"""Transformer blocks and stacks.

A ``Block`` is self-attention, optional cross-attention and a feed-forward network, each a
residual sub-layer in pre-norm (``x + f(norm(x))``) or post-norm (``norm(x + f(x))``)
placement. A ``Stack`` owns what is per-stack: absolute or relative positions, an optional
embedding norm, the blocks and an optional final norm; it builds the masks and position
biases once and shares them across its blocks.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attnlab import ops
from attnlab.config import ModelConfig
from attnlab.nn.attention import Attention
from attnlab.nn.layers import FeedForward, LearnedPositions, Norm, RelativeBias, dropout, fold


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
        cache_start_B=None,
        key=None,
        return_weights=False,
    ):
        """Returns ``(x_BTD, self_kv, cross_kv, weights)``; weights is a dict or None."""
        x_BTD, (self_kv, w_self) = self._residual(
            x_BTD,
            self.attn_norm,
            lambda h: self.attn(
                h,
                positions_BT=positions_BT,
                mask=mask,
                bias=bias,
                cache=cache,
                cache_start_B=cache_start_B,
                key=fold(key, 0),
                return_weights=return_weights,
            ),
            fold(key, 1),
        )
        cross_kv, w_cross = None, None
        if self.cross_attn is not None:
            x_BTD, (cross_kv, w_cross) = self._residual(
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
        x_BTD, _ = self._residual(
            x_BTD, self.ffn_norm, lambda h: (self.ffn(h, key=fold(key, 4)),), fold(key, 5)
        )
        weights = None
        if return_weights:
            weights = {"self": w_self} if w_cross is None else {"self": w_self, "cross": w_cross}
        return x_BTD, self_kv, cross_kv, weights


class Stack(nnx.Module):
    """Positions + blocks + final norm over embedded tokens (encoder or decoder side)."""

    def __init__(
        self, cfg: ModelConfig, n_layers: int, *, causal: bool, cross: bool, rngs: nnx.Rngs
    ):
        self.cfg = cfg
        self.causal = causal
        self.positions = LearnedPositions(cfg, rngs=rngs) if cfg.position == "learned" else None
        self.relative = (
            RelativeBias(cfg, bidirectional=not causal, rngs=rngs)
            if cfg.position == "relative"
            else None
        )
        self.embed_norm = Norm(cfg, cfg.d_model, rngs=rngs) if cfg.embedding_norm else None
        self.layers = nnx.List([Block(cfg, cross=cross, rngs=rngs) for _ in range(n_layers)])
        self.final_norm = Norm(cfg, cfg.d_model, rngs=rngs) if cfg.use_final_norm else None

    def _self_mask(self, T, S, positions_BT, valid_BS, segment_ids_BT, cache_start_B):
        cfg = self.cfg
        offset = 0 if cache_start_B is None else cache_start_B
        causal = ops.causal(T, S, offset=offset) if self.causal else None
        window = (
            ops.sliding_window(T, S, window=cfg.sliding_window, offset=offset)
            if cfg.sliding_window and self.causal
            else None
        )
        if cache_start_B is not None:
            # Keys past what has been written are invalid even without a causal mask.
            written = ops.lengths_to_valid(cache_start_B + T, S)
            return ops.combine(causal, window, ops.padding(k_valid_BS=written))
        segments = None if segment_ids_BT is None else ops.segment(segment_ids_BT)
        return ops.combine(causal, window, ops.padding(k_valid_BS=valid_BS), segments)

    def _bias(self, q_positions_BT, k_positions_BS):
        if self.relative is not None:
            return self.relative(q_positions_BT, k_positions_BS)
        if self.cfg.position == "alibi":
            return ops.alibi_bias(
                ops.alibi_slopes(self.cfg.n_heads), q_positions_BT, k_positions_BS
            )
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
        key=None,
        return_weights=False,
    ):
        """Runs the stack. ``cache``/``cross_cache`` are per-layer lists of (k, v) or None.

        Returns ``(x_BTD, new_cache, new_cross_cache, weights)``.
        """
        B, T, _ = x_BTD.shape
        x_BTD = dropout(
            self.embed_positions(x_BTD, positions_BT), self.cfg.dropout, fold(key, 1_000_000)
        )
        if cache is not None:
            S = cache[0][0].shape[2]  # head-major [B, K, S, H]
            k_positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (B, S))
        else:
            S, k_positions_BS = T, positions_BT
        mask = self._self_mask(T, S, positions_BT, valid_BS, segment_ids_BT, cache_start_B)
        bias = self._bias(positions_BT, k_positions_BS)
        cross_mask = None if enc_valid_BS is None else ops.padding(k_valid_BS=enc_valid_BS)

        new_cache, new_cross, weights = [], [], []
        for i, block in enumerate(self.layers):
            x_BTD, kv, cross_kv, w = block(
                x_BTD,
                positions_BT=positions_BT,
                mask=mask,
                bias=bias,
                enc_BSD=enc_BSD,
                cross_mask=cross_mask,
                cache=None if cache is None else cache[i],
                cross_cache=None if cross_cache is None else cross_cache[i],
                cache_start_B=cache_start_B,
                key=fold(key, i),
                return_weights=return_weights,
            )
            new_cache.append(kv)
            new_cross.append(cross_kv)
            weights.append(w)
        if self.final_norm is not None:
            x_BTD = self.final_norm(x_BTD)
        return x_BTD, new_cache, new_cross, (tuple(weights) if return_weights else None)
