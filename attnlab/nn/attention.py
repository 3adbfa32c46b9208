"""Multi-head attention (MHA / GQA / MQA) for self- and cross-attention.

Projections are stored as ``q_DNH``, ``k_DKH``, ``v_DKH`` and ``o_NHD``, so ``head_dim`` is
independent of ``d_model / n_heads``. The module computes q, k, v, applies QK-norm and RoPE,
optionally appends k and v to its layer of an explicit cache (a ``kv_cache.LayerView``),
and calls the attention function that ``ModelConfig.attention_fn`` named when the module
was built (``attnlab.variants``), passing ``block_q``/``block_k`` too when the config sets
``attention_block_q``/``attention_block_k``. It returns ``(out_BTD, cache, weights_BNTS |
None)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attnlab import ops
from attnlab.config import ModelConfig
from attnlab.nn.context_parallel import ContextMask
from attnlab.nn.layers import Norm, normal
from attnlab.ops.linear import add_bias, dense
from attnlab.sharding import constrain
from attnlab.variants import get_attention


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, cross: bool = False, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        std, pd = cfg.init_std, cfg.param_dtype
        self.cfg = cfg
        self.cross = cross
        self.attend = get_attention(cfg.attention_fn)  # resolved now: part of the graph
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
        key=None,
        return_weights=False,
    ):
        """Attention of ``x`` over itself, or over ``kv_BSD`` / a cache for cross-attention.

        Self-attention with ``cache`` (a ``kv_cache.LayerView``) appends this call's keys
        and values and attends over the layer's whole cache (the mask selects what is
        valid). Cross-attention with ``cache=(k_BSKH, v_BSKH)`` uses those as they are.
        Given a ``ContextMask`` as its mask (``attnlab.nn.context_parallel``: the sequence
        split over the mesh), self-attention runs context-parallel, without weights.
        """
        cfg = self.cfg
        q_BTNH = self._project(x_BTD, self.q_DNH, self.q_bias_NH)
        if self.q_norm is not None:
            q_BTNH = self.q_norm(q_BTNH)
        if cfg.position == "rope" and not self.cross:
            q_BTNH = ops.apply_rope(q_BTNH, positions_BT, theta=cfg.rope_theta)
        q_BTNH = constrain(q_BTNH, "batch", "length", "act_heads", None)

        if self.cross:
            k_BSKH, v_BSKH = cache if cache is not None else self.project_kv(kv_BSD)
        elif cache is None:
            k_BSKH, v_BSKH = self.project_kv(x_BTD, positions_BT)
        else:
            cache, k_BSKH, v_BSKH = cache.append(*self.project_kv(x_BTD, positions_BT))
        if isinstance(mask, ContextMask) and not self.cross:  # the sequence is split
            out_BTNH = mask.attend(
                q_BTNH,
                k_BSKH.astype(q_BTNH.dtype),
                v_BSKH.astype(q_BTNH.dtype),
                scale=cfg.attn_scale,
                dropout_rate=cfg.attention_dropout,
                dropout_key=key if cfg.attention_dropout > 0 else None,
            )
            return self._output(out_BTNH), cache, None
        dt = q_BTNH.dtype
        blocks = {
            name: value
            for name, value in (
                ("block_q", cfg.attention_block_q),
                ("block_k", cfg.attention_block_k),
            )
            if value is not None
        }
        result = self.attend(
            q_BTNH,
            k_BSKH.astype(dt),
            v_BSKH.astype(dt),
            mask=mask,
            bias=bias,
            scale=cfg.attn_scale,
            return_weights=return_weights,
            implementation=cfg.attention_impl,
            dropout_rate=cfg.attention_dropout,
            dropout_key=key if cfg.attention_dropout > 0 else None,
            **blocks,
        )
        out_BTNH, weights_BNTS = result if return_weights else (result, None)
        return self._output(out_BTNH), cache, weights_BNTS

    def _output(self, out_BTNH):
        out_BTD = dense(out_BTNH, self.o_NHD[...], n_in=2)
        if self.o_bias_D is not None:
            out_BTD = add_bias(out_BTD, self.o_bias_D[...])
        return out_BTD
