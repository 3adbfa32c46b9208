"""Multi-head attention (MHA / GQA / MQA) for self- and cross-attention.

Projections are stored as ``q_DNH``, ``k_DKH``, ``v_DKH`` and ``o_NHD``, so ``head_dim`` is
independent of ``d_model / n_heads``. The module computes q, k, v, applies QK-norm and RoPE,
optionally writes k and v into an explicit per-layer cache ``(k_BKSH, v_BKSH)`` (head-major,
see ``attnlab.kv_cache``) at each row's own offset, and calls the configured attention
function from ``attnlab.variants``. It returns ``(out_BTD, new_cache, weights_BNTS | None)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attnlab import kv_cache, ops
from attnlab.config import ModelConfig
from attnlab.nn.layers import Norm, add_bias, dense, dropout, normal
from attnlab.variants import get_attention


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, cross: bool = False, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
        std, pd = cfg.init_std, cfg.param_dtype
        self.cfg = cfg
        self.cross = cross
        self.q_DNH = normal(rngs, (D, N, H), std, pd)
        self.k_DKH = normal(rngs, (D, K, H), std, pd)
        self.v_DKH = normal(rngs, (D, K, H), std, pd)
        self.o_NHD = normal(rngs, (N, H, D), std / (2 * cfg.n_layers) ** 0.5, pd)
        zeros = lambda *s: nnx.Param(jnp.zeros(s, jnp.dtype(pd)))
        self.q_bias_NH = zeros(N, H) if cfg.attn_bias else None
        self.k_bias_KH = zeros(K, H) if cfg.attn_bias else None
        self.v_bias_KH = zeros(K, H) if cfg.attn_bias else None
        self.o_bias_D = zeros(D) if cfg.out_bias else None
        use_qk_norm = cfg.qk_norm and not cross
        self.q_norm = Norm(cfg, H, rngs=rngs, kind="rmsnorm") if use_qk_norm else None
        self.k_norm = Norm(cfg, H, rngs=rngs, kind="rmsnorm") if use_qk_norm else None

    def _project(self, x, w, b):
        y = dense(x, w[...])
        return y if b is None else add_bias(y, b[...])

    def project_kv(self, x_BSD, positions_BS=None):
        """Keys and values of ``x`` (with k-norm and RoPE when configured)."""
        k_BSKH = self._project(x_BSD, self.k_DKH, self.k_bias_KH)
        v_BSKH = self._project(x_BSD, self.v_DKH, self.v_bias_KH)
        if self.k_norm is not None:
            k_BSKH = self.k_norm(k_BSKH)
        if self.cfg.position == "rope" and not self.cross:
            k_BSKH = ops.apply_rope(k_BSKH, positions_BS, theta=self.cfg.rope_theta)
        return k_BSKH, v_BSKH

    def __call__(
        self,
        x_BTD,
        *,
        positions_BT=None,
        mask=None,
        bias=None,
        kv_BSD=None,
        cache=None,
        cache_start_B=None,
        key=None,
        return_weights=False,
    ):
        """Attention of ``x`` over itself, or over ``kv_BSD`` / a cache for cross-attention.

        Self-attention with ``cache=(k_BKSH, v_BKSH)`` writes this call's keys and values at
        ``cache_start_B`` and attends over the whole cache (the mask selects what is valid).
        Cross-attention with ``cache`` uses the cached encoder keys and values as they are.
        """
        cfg = self.cfg
        q_BTNH = self._project(x_BTD, self.q_DNH, self.q_bias_NH)
        if self.q_norm is not None:
            q_BTNH = self.q_norm(q_BTNH)
        if cfg.position == "rope" and not self.cross:
            q_BTNH = ops.apply_rope(q_BTNH, positions_BT, theta=cfg.rope_theta)

        if self.cross:
            new_cache = cache if cache is not None else self.project_kv(kv_BSD)
        else:
            new_cache = self.project_kv(x_BTD, positions_BT)
            if cache is not None:
                new_cache = tuple(
                    kv_cache.write(c_BKSH, u_BTKH, cache_start_B)
                    for c_BKSH, u_BTKH in zip(cache, new_cache, strict=True)
                )
        # A cache is head-major, [B, K, S, H] (attnlab.kv_cache): XLA folds the swap into the
        # attention dots, so the cache is read in place.
        k_BSKH, v_BSKH = (
            new_cache if cache is None else (jnp.swapaxes(x_BKSH, 1, 2) for x_BKSH in new_cache)
        )

        attend = get_attention(cfg.attention_fn)
        need_weights = return_weights or (key is not None and cfg.attention_dropout > 0)
        result = attend(
            q_BTNH,
            k_BSKH.astype(q_BTNH.dtype),
            v_BSKH.astype(q_BTNH.dtype),
            mask=mask,
            bias=bias,
            scale=cfg.scale,
            return_weights=need_weights,
            implementation=cfg.attention_impl,
        )
        weights_BNTS = None
        if need_weights:
            out_BTNH, weights_BNTS = result
            if key is not None and cfg.attention_dropout > 0:
                dropped = dropout(weights_BNTS, cfg.attention_dropout, key)
                out_BTNH = jnp.einsum(
                    "BNTS,BSNH->BTNH",
                    dropped.astype(q_BTNH.dtype),
                    _repeat_kv(v_BSKH, cfg).astype(q_BTNH.dtype),
                )
        else:
            out_BTNH = result
        out_BTD = dense(out_BTNH, self.o_NHD[...], n_in=2)
        if self.o_bias_D is not None:
            out_BTD = add_bias(out_BTD, self.o_bias_D[...])
        return out_BTD, new_cache, (weights_BNTS if return_weights else None)


def _repeat_kv(v_BSKH, cfg):
    return jnp.repeat(v_BSKH, cfg.n_heads // cfg.kv_heads, axis=2)
