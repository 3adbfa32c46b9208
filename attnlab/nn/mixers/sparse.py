"""DeepSeek Sparse Attention (DeepSeek-V3.2-Exp, 2025), ``mixer="dsa"``: multi-head latent
attention (``mixer="mla"``) over the keys a lightning indexer selects per query.

The indexer (``attnlab.ops.sparse_index``) has ``index_heads`` heads of width
``index_head_dim`` (``Hi``); its queries come from the compressed query (``x`` without q
compression), its one key per token from ``x``::

    q_I = W_Iq c_q,  k_I = LayerNorm(W_Ik x),  w = W_Iw x / sqrt(index_heads)
    I[t, s] = sum_n w[t, n] ReLU(q_I[t, n] . k_I[s] / sqrt(Hi))

with RoPE (the house's half-split layout, the layer's base) on the first
``qk_rope_head_dim`` values of ``q_I`` and ``k_I``. Each query keeps its ``topk`` allowed
keys of highest ``I`` (all of them when fewer are allowed), and MLA attends over those
alone: the selection is a boolean mask on the attention op, whose blockwise paths
(``attnlab.ops.flex``, ``attnlab.ops.chunked``) skip the key blocks no query of a block
kept. A ``topk`` at least the sequence's length is MLA.

Training the indexer: ``KL(p || softmax(I))`` per query, ``p`` the main attention's weights
summed over the heads and L1-normalised (``indexer_loss="dense"``: over every allowed key,
the warm-up form; ``"sparse"``: over the kept keys). The indexer reads ``x`` and ``c_q``
with their gradients stopped and ``p`` is a target, so this loss trains the indexer alone
and the language-modelling loss (which cannot reach the indexer through the top-k) the rest.
A layer computes it when the stack collects ``"indexer_kl"`` (training, through the step
metric ``dsa_indexer``, which adds ``indexer_loss_weight`` times the loss per counted
token, summed over the layers).

Parameters beside MLA's: ``index_q_RNH`` (``index_q_DNH`` without q compression),
``index_k_DH``, ``index_k_scale_H``, ``index_k_bias_H`` (the key's LayerNorm, eps
``index_norm_eps``) and ``index_w_DN``. Cache: MLA's latent and rope keys, and the
indexer's key per token (``"index_keys"``, ``[S, Hi]``); a decoding step scores the cached
keys and keeps its top ``topk``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import ops
from attnlab.contracts.mixer import SLOTS, CacheEntry, MixerCall, register_mixer
from attnlab.errors import ConfigError
from attnlab.nn.layers import normal
from attnlab.nn.mixers.mla import LatentAttention
from attnlab.ops import sparse_index
from attnlab.ops.chunked import DEFAULT_BLOCK_Q
from attnlab.ops.linear import dense
from attnlab.ops.precision import wide

LOSS_FORMS = ("sparse", "dense")


@register_mixer("dsa")
class SparseAttention(LatentAttention):
    """MLA over each query's top-k keys by a lightning indexer (the module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(LatentAttention.Settings):
        topk: int = 2048  # keys kept per query (DeepSeek-V3.2: 2048)
        index_heads: int = 4  # DeepSeek-V3.2: 64
        index_head_dim: int | None = None  # None: head_dim (DeepSeek-V3.2: 128)
        index_norm_eps: float = 1e-6
        indexer_loss: str = "sparse"  # "dense": the warm-up form over every allowed key
        indexer_loss_weight: float = 1.0  # the default of train.loss_weights.dsa_indexer

        def resolved(self, cfg) -> SparseAttention.Settings:
            s = super().resolved(cfg)
            if s.index_head_dim is None:
                s = dataclasses.replace(s, index_head_dim=cfg.head_dim)
            return s

        def validate(self, cfg):
            super().validate(cfg)
            for field in ("topk", "index_heads", "index_head_dim"):
                value = getattr(self, field)
                if value is None and field == "index_head_dim":
                    continue
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    self.fail(field, "a positive int")
            s = self.resolved(cfg)
            if cfg.position == "rope" and s.index_head_dim < s.qk_rope_head_dim:
                self.fail(
                    "index_head_dim",
                    f"at least qk_rope_head_dim={s.qk_rope_head_dim}: RoPE rotates the "
                    "indexer's first qk_rope_head_dim values",
                )
            for field, positive in (("index_norm_eps", True), ("indexer_loss_weight", False)):
                value = getattr(self, field)
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if not number or not math.isfinite(value) or value < 0 or (positive and not value):
                    self.fail(field, "a positive number" if positive else "a finite number >= 0")
            if self.indexer_loss not in LOSS_FORMS:
                self.fail("indexer_loss", f"one of {LOSS_FORMS}")
            if not cfg.causal:
                raise ConfigError(
                    "ModelConfig.causal=False is invalid with mixer='dsa': the indexer selects "
                    "past keys per query (causal attention); set causal=True"
                )
            if cfg.position in ("alibi", "relative"):
                raise ConfigError(
                    f"ModelConfig.position={cfg.position!r} is invalid with mixer='dsa': its "
                    "indexer takes positions from RoPE; set position='rope'"
                )

    # The split sequence's ring and all-gather paths take no per-query key selection.
    context_parallel = False

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        settings = (settings or self.Settings()).resolved(cfg)
        super().__init__(cfg, settings, rngs=rngs)
        D, J, Hi = cfg.d_model, settings.index_heads, settings.index_head_dim
        std, pd = cfg.init_std, cfg.param_dtype
        if settings.q_lora_rank is None:
            self.index_q_DNH = normal(rngs, (D, J, Hi), std, pd)
            self.index_q_RNH = None
        else:
            self.index_q_DNH = None
            self.index_q_RNH = normal(rngs, (settings.q_lora_rank, J, Hi), std, pd)
        self.index_k_DH = normal(rngs, (D, Hi), std, pd)
        self.index_k_scale_H = nnx.Param(jnp.ones((Hi,), jnp.dtype(pd)))
        self.index_k_bias_H = nnx.Param(jnp.zeros((Hi,), jnp.dtype(pd)))
        self.index_w_DN = normal(rngs, (D, J), std, pd)

    @classmethod
    def cache_entries(cls, cfg, settings):
        s = (settings or cls.Settings()).resolved(cfg)
        entry = CacheEntry((SLOTS, s.index_head_dim), axes=(None, None))
        return {**super().cache_entries(cfg, s), "index_keys": entry}

    def lightning_indexer(self, x_BTD, c_q_BTR, call: MixerCall):
        """``(q_I_BTNH, k_I_BTH, w_BTN)``: the indexer's queries, keys and head weights, of
        the inputs with their gradients stopped."""
        s = self.settings
        x_BTD = jax.lax.stop_gradient(x_BTD)
        if self.index_q_DNH is not None:
            q_BTNH = dense(x_BTD, self.index_q_DNH[...])
        else:
            q_BTNH = dense(jax.lax.stop_gradient(c_q_BTR), self.index_q_RNH[...])
        k_BTH = ops.layer_norm(
            dense(x_BTD, self.index_k_DH[...]), self.index_k_scale_H[...],
            self.index_k_bias_H[...], eps=s.index_norm_eps,
        ).astype(q_BTNH.dtype)  # fmt: skip
        Hr = s.qk_rope_head_dim
        rope = lambda a: self._rope(a, call.positions_BT, call.rope_theta)
        q_BTNH = jnp.concatenate([rope(q_BTNH[..., :Hr]), q_BTNH[..., Hr:]], axis=-1)
        k_BTH = jnp.concatenate([rope(k_BTH[:, :, None, :Hr])[:, :, 0], k_BTH[..., Hr:]], -1)
        w_BTN = dense(x_BTD, self.index_w_DN[...], out_dtype=wide(x_BTD))
        return q_BTNH, k_BTH, w_BTN * s.index_heads**-0.5

    @staticmethod
    def allowed(mask, B, T, S):
        """The call's mask as a ``[B, T, S]`` boolean array (True = may attend)."""
        if mask is None:
            return jnp.ones((B, T, S), bool)
        mask = mask.dense() if isinstance(mask, ops.MaskSpec) else mask
        return jnp.broadcast_to(jnp.asarray(mask, bool)[:, 0], (B, T, S))

    def indexer_loss(self, q_BTNH, kv_BSH, scores_BTS, allowed_BTS, kept_BTS):
        """``{"kl_sum", "rows"}``: the indexer's KL summed over the queries, and the number
        of queries with a support (float32 scalars). ``q_BTNH``, ``kv_BSH``: the main
        attention's ``(q_nope, q_rope)`` and ``(c, k_rope)``, whose logits (in the
        weight-absorbed form, gradients stopped) give the target ``p``, a block of queries
        at a time."""
        f32, sg = jnp.float32, jax.lax.stop_gradient
        k_up_RNH = sg(self.k_up_RNH[...]).astype(f32)
        c_BSR, k_rope_BSH = (sg(a).astype(f32) for a in kv_BSH)
        scale = self.scale
        support_BTS = kept_BTS if self.settings.indexer_loss == "sparse" else allowed_BTS

        def kl(q_nope_BTNH, q_rope_BTNH, scores_BTS, support_BTS):
            q_lat_BTNR = jnp.einsum("BTNH,RNH->BTNR", sg(q_nope_BTNH).astype(f32), k_up_RNH)
            logits_BNTS = jnp.einsum("BTNR,BSR->BNTS", q_lat_BTNR, c_BSR)
            logits_BNTS += jnp.einsum("BTNH,BSH->BNTS", sg(q_rope_BTNH).astype(f32), k_rope_BSH)
            p_BTS = sg(sparse_index.attention_target(logits_BNTS * scale, support_BTS))
            return sparse_index.indexer_kl(p_BTS, scores_BTS, support_BTS)

        kl_BT = sparse_index.over_queries(kl, self.block_q, *q_BTNH, scores_BTS, support_BTS)
        rows = jnp.sum(jnp.any(support_BTS, axis=-1)).astype(jnp.float32)
        return {"kl_sum": jnp.sum(kl_BT), "rows": rows}

    @property
    def block_q(self) -> int:
        """The queries scored at a time (``ModelConfig.attention_block_q``, else the chunked
        path's default)."""
        return self.cfg.attention_block_q or DEFAULT_BLOCK_Q

    def __call__(self, x_BTD, call: MixerCall):
        c_q_BTR = self.query_latent(x_BTD)
        q_nope_BTNH, q_rope_BTNH = self.query(x_BTD, call, c_q_BTR)
        cache, c_BSR, k_rope_BSH = self.keys_values(x_BTD, call)
        q_I_BTNH, k_I_BTH, w_BTN = self.lightning_indexer(x_BTD, c_q_BTR, call)
        k_I_BSH = k_I_BTH
        if cache is not None:
            cache, k_I_BSH = cache.append("index_keys", k_I_BTH)
        B, T = x_BTD.shape[:2]
        allowed_BTS = self.allowed(call.mask, B, T, c_BSR.shape[1])
        scale = self.settings.index_head_dim**-0.5
        scores_BTS = sparse_index.index_scores(
            q_I_BTNH, k_I_BSH, w_BTN, scale=scale, block_q=self.block_q
        )
        kept_BTS = sparse_index.top_k_mask(scores_BTS, allowed_BTS, self.settings.topk)
        kept = kept_BTS[:, None]
        if isinstance(call.mask, ops.MaskSpec):  # the keys' positions stay with the choice
            kept = call.mask.replace(allowed=kept)
        sparse = call.replace(mask=kept)
        step = call.cache is not None and T == 1
        attend = self.attend_absorbed if step else self.attend_expanded
        out_BTNH, weights_BNTS = attend(q_nope_BTNH, q_rope_BTNH, c_BSR, k_rope_BSH, sparse)
        if "indexer_kl" in call.collect and call.cache is None:
            q_BTNH, kv_BSH = (q_nope_BTNH, q_rope_BTNH), (c_BSR, k_rope_BSH)
            loss = self.indexer_loss(q_BTNH, kv_BSH, scores_BTS, allowed_BTS, kept_BTS)
            self.sow(nnx.Intermediate, "indexer_kl", loss)
        return self.output(out_BTNH, x_BTD), cache, weights_BNTS
