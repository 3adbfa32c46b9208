"""Multi-head latent attention (DeepSeek-V2, DeepSeek-V3), ``mixer="mla"``.

Keys and values come from one compressed latent per token; a small decoupled key carries
the positions and is shared by the heads (``Hn = qk_nope_head_dim``, ``Hr =
qk_rope_head_dim``, ``Hv = v_head_dim``, ``R = kv_lora_rank``)::

    q      = W_uq RMSNorm(W_dq x)     (or W_q x without q compression), [q_nope ; q_rope]
    c      = RMSNorm(W_dkv x)                       the latent, R values per token
    k_rope = RoPE(W_kr x)                           Hr values per token, shared by the heads
    k_n    = [W_uk,n c ; k_rope],  v_n = W_uv,n c,  q_rope rotated by RoPE as well
    out    = concat_n[softmax(q_n k_n^T / sqrt(Hn + Hr)) v_n] W_o

Parameters: ``q_DNH`` or ``q_down_DR``, ``q_norm``, ``q_up_RNH`` (with ``q_lora_rank``);
``kv_down_DR``, ``kv_norm``, ``k_rope_DH``, ``k_up_RNH``, ``v_up_RNH`` and ``o_NHD`` (``R``
is a latent's width, ``H`` the head width each projection has). ``ModelConfig.head_dim``
serves only as the default of the head widths; the RMSNorms' eps is
``ModelConfig.norm_eps``. The logit scale is ``(Hn + Hr) ** -0.5`` unless
``ModelConfig.attn_scale`` is set.

Positions: RoPE (with the layer's base) rotates ``q_rope`` and ``k_rope`` alone when
``ModelConfig.position == "rope"`` (the house's half-split layout); with any other position
the decoupled part is an unrotated shared key and positions come from where the config
puts them (embeddings, or an ALiBi/relative bias, which joins the logits as for ``mha``).

Cache: the latent ``c`` (``"latent"``, ``[S, R]``) and the rotated ``k_rope``
(``"rope_keys"``, ``[S, Hr]``) per token, never keys or values: ``R + Hr`` values per token
and layer, DeepSeek-V3's 512 + 64 = 576. A prefill up-projects the cached latents to keys
and values and attends as ``mha`` does (the chunked path and the mesh's context axis
included); a decode step (one token over the cache) uses the weight-absorbed form, which
is multi-query attention over the latent: ``q_lat_n = W_uk,n^T q_nope_n``, keys
``[c ; k_rope]``, values ``c``, then ``out_n = W_uv,n (softmax(...) c)``, so no step
up-projects the cache. The score functions take keys and values of one shape: the shorter
of q/k and v is zero-padded (which changes no logit and no output), and the absorbed form
passes ``[c ; k_rope]`` as both keys and values and keeps the output's first R values.

Settings left None are derived from the config: ``kv_lora_rank = min(4 * head_dim,
d_model)``, ``qk_nope_head_dim = v_head_dim = head_dim``, ``qk_rope_head_dim`` the even
number nearest below ``head_dim / 2`` (at least 2); ``q_lora_rank=None`` means no q
compression.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import SLOTS, CacheEntry, MixerCall, MixerSettings, register_mixer
from attnlab.devices.sharding import constrain
from attnlab.errors import ConfigError
from attnlab.nn.layers import Norm, normal
from attnlab.nn.mixers.mha import Attention
from attnlab.ops.linear import dense


def _pad_to(x, size):
    """``x`` with zeros appended on its last axis up to ``size``."""
    pad = size - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


@register_mixer("mla")
class LatentAttention(Attention):
    """Multi-head latent attention (see the module docstring); shares ``Attention.attend``
    and ``Attention.output``, has no cross-attention form."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        kv_lora_rank: int | None = None
        q_lora_rank: int | None = None  # None: q = W_q x
        qk_nope_head_dim: int | None = None
        qk_rope_head_dim: int | None = None
        v_head_dim: int | None = None
        latent_norm_eps: float | None = None  # the latents' RMSNorms (None: norm_eps)

        def resolved(self, cfg) -> LatentAttention.Settings:
            """The settings with the fields left None derived from ``cfg`` (but
            ``q_lora_rank``, whose None means no compression)."""
            H = cfg.head_dim
            derived = {
                "kv_lora_rank": min(4 * H, cfg.d_model),
                "qk_nope_head_dim": H,
                "qk_rope_head_dim": max(2, H // 2 // 2 * 2),
                "v_head_dim": H,
            }
            return dataclasses.replace(
                self, **{k: v for k, v in derived.items() if getattr(self, k) is None}
            )

        def validate(self, cfg):
            for field in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                          "qk_rope_head_dim", "v_head_dim"):  # fmt: skip
                value = getattr(self, field)
                if value is not None and (not isinstance(value, int) or value < 1):
                    self.fail(field, "a positive int (or None for the default)")
            eps = self.latent_norm_eps
            if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))
                                    or not eps > 0):  # fmt: skip
                self.fail("latent_norm_eps", "a positive number (or None for norm_eps)")
            for field in ("kv_lora_rank", "q_lora_rank"):
                value = getattr(self, field)
                if value is not None and value > cfg.d_model:
                    self.fail(field, f"a low-rank latent no wider than d_model={cfg.d_model}")
            rope = self.resolved(cfg).qk_rope_head_dim
            if cfg.position == "rope" and rope % 2:
                self.fail("qk_rope_head_dim", "an even size: RoPE rotates pairs")
            for field in ("attn_bias", "qk_norm"):
                if getattr(cfg, field):
                    raise ConfigError(
                        f"ModelConfig.{field}=True is invalid: mixer='mla' has no q/k/v "
                        "biases and normalises its latents instead of q and k; set it False"
                    )

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        # Not Attention.__init__: MLA has its own projections; it keeps Attention's steps.
        s = (settings or self.Settings()).resolved(cfg)
        D, N, R = cfg.d_model, cfg.n_heads, s.kv_lora_rank
        Hn, Hr, Hv = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
        std, pd = cfg.init_std, cfg.param_dtype
        self.init_attend(cfg, None)  # no cap: what Attention.attend reads
        self.settings = s
        if s.q_lora_rank is None:
            self.q_DNH = normal(rngs, (D, N, Hn + Hr), std, pd)
            self.q_down_DR = self.q_norm = self.q_up_RNH = None
        else:
            self.q_DNH = None
            self.q_down_DR = normal(rngs, (D, s.q_lora_rank), std, pd)
            self.q_norm = Norm(cfg, s.q_lora_rank, rngs=rngs, kind="rmsnorm")
            self.q_up_RNH = normal(rngs, (s.q_lora_rank, N, Hn + Hr), std, pd)
        self.kv_down_DR = normal(rngs, (D, R), std, pd)
        self.kv_norm = Norm(cfg, R, rngs=rngs, kind="rmsnorm")
        self.k_rope_DH = normal(rngs, (D, Hr), std, pd)
        self.k_up_RNH = normal(rngs, (R, N, Hn), std, pd)
        self.v_up_RNH = normal(rngs, (R, N, Hv), std, pd)
        self.o_NHD = normal(rngs, (N, Hv, D), std / (2 * cfg.n_layers) ** 0.5, pd)
        self.o_bias_D = nnx.Param(jnp.zeros((D,), jnp.dtype(pd))) if cfg.out_bias else None
        if s.latent_norm_eps is not None:
            for norm in (self.q_norm, self.kv_norm):
                if norm is not None:
                    norm.eps = float(s.latent_norm_eps)

    @classmethod
    def cache_entries(cls, cfg, settings):
        s = (settings or cls.Settings()).resolved(cfg)
        return {
            "latent": CacheEntry((SLOTS, s.kv_lora_rank), axes=(None, None)),
            "rope_keys": CacheEntry((SLOTS, s.qk_rope_head_dim), axes=(None, None)),
        }

    @property
    def scale(self):
        s = self.settings
        if "attn_scale" in self.cfg._derived:
            return (s.qk_nope_head_dim + s.qk_rope_head_dim) ** -0.5
        return self.cfg.attn_scale

    def query_latent(self, x_BTD):
        """The compressed query ``RMSNorm(W_dq x)``, or None without q compression."""
        if self.q_down_DR is None:
            return None
        return self.q_norm(dense(x_BTD, self.q_down_DR[...]))

    def query(self, x_BTD, call: MixerCall, c_q_BTR=None):
        """``(q_nope_BTNH, q_rope_BTNH)``, the second rotated (``c_q_BTR``: the compressed
        query when the caller computed it already)."""
        if self.q_DNH is not None:
            q_BTNH = dense(x_BTD, self.q_DNH[...])
        else:
            c_q_BTR = self.query_latent(x_BTD) if c_q_BTR is None else c_q_BTR
            q_BTNH = dense(c_q_BTR, self.q_up_RNH[...])
        q_BTNH = constrain(q_BTNH, "batch", "length", "act_heads", None)
        Hn = self.settings.qk_nope_head_dim
        q_rope_BTNH = self._rope(q_BTNH[..., Hn:], call.positions_BT, call.rope_theta)
        return q_BTNH[..., :Hn], q_rope_BTNH

    def latent(self, x_BTD, call: MixerCall):
        """``(c_BTR, k_rope_BTH)``: what the cache keeps of each token."""
        c_BTR = self.kv_norm(dense(x_BTD, self.kv_down_DR[...]))
        k_rope_BT1H = dense(x_BTD, self.k_rope_DH[...])[:, :, None, :]
        k_rope_BT1H = self._rope(k_rope_BT1H, call.positions_BT, call.rope_theta)
        return c_BTR, k_rope_BT1H[:, :, 0, :]

    def keys_values(self, x_BTD, call: MixerCall):
        """``(cache, c_BSR, k_rope_BSH)``: this call's latents and rope keys, after what the
        cache holds when decoding (the cache then holds them too)."""
        c_BTR, k_rope_BTH = self.latent(x_BTD, call)
        cache = call.cache
        if cache is None:
            return None, c_BTR, k_rope_BTH
        cache, c_BSR = cache.append("latent", c_BTR)
        cache, k_rope_BSH = cache.append("rope_keys", k_rope_BTH)
        return cache, c_BSR, k_rope_BSH

    def attend_expanded(self, q_nope_BTNH, q_rope_BTNH, c_BSR, k_rope_BSH, call: MixerCall):
        """Keys and values up-projected from the latents, then ``Attention.attend``."""
        dt = q_nope_BTNH.dtype
        c_BSR, k_rope_BSH = c_BSR.astype(dt), k_rope_BSH.astype(dt)
        B, S, _ = c_BSR.shape
        N, Hr = q_rope_BTNH.shape[2:]
        k_BSNH = jnp.concatenate(
            [
                dense(c_BSR, self.k_up_RNH[...]),
                jnp.broadcast_to(k_rope_BSH[:, :, None, :], (B, S, N, Hr)),
            ],
            axis=-1,
        )
        v_BSNH = dense(c_BSR, self.v_up_RNH[...])
        q_BTNH = jnp.concatenate([q_nope_BTNH, q_rope_BTNH], axis=-1)
        Hv = v_BSNH.shape[-1]
        H = max(q_BTNH.shape[-1], Hv)
        q_BTNH, k_BSNH, v_BSNH = (_pad_to(a, H) for a in (q_BTNH, k_BSNH, v_BSNH))
        out_BTNH, weights_BNTS = self.attend(q_BTNH, k_BSNH, v_BSNH, call, scale=self.scale)
        return out_BTNH[..., :Hv], weights_BNTS

    def attend_absorbed(self, q_nope_BTNH, q_rope_BTNH, c_BSR, k_rope_BSH, call: MixerCall):
        """The weight-absorbed form: multi-query attention over ``[c ; k_rope]``."""
        dt = q_nope_BTNH.dtype
        q_lat_BTNR = jnp.einsum("BTNH,RNH->BTNR", q_nope_BTNH, self.k_up_RNH[...].astype(dt))
        q_BTNH = jnp.concatenate([q_lat_BTNR, q_rope_BTNH], axis=-1)
        kv_BS1H = jnp.concatenate([c_BSR, k_rope_BSH], axis=-1).astype(dt)[:, :, None, :]
        out_BTNH, weights_BNTS = self.attend(q_BTNH, kv_BS1H, kv_BS1H, call, scale=self.scale)
        R = c_BSR.shape[-1]
        out_BTNH = jnp.einsum("BTNR,RNH->BTNH", out_BTNH[..., :R], self.v_up_RNH[...].astype(dt))
        return out_BTNH, weights_BNTS

    def __call__(self, x_BTD, call: MixerCall):
        q_nope_BTNH, q_rope_BTNH = self.query(x_BTD, call)
        cache, c_BSR, k_rope_BSH = self.keys_values(x_BTD, call)
        step = call.cache is not None and x_BTD.shape[1] == 1
        attend = self.attend_absorbed if step else self.attend_expanded
        out_BTNH, weights_BNTS = attend(q_nope_BTNH, q_rope_BTNH, c_BSR, k_rope_BSH, call)
        return self.output(out_BTNH, x_BTD), cache, weights_BNTS

    def cross_attend(self, x_BTD, call: MixerCall, *, kv_BSD=None, kv=None):
        raise NotImplementedError("mixer 'mla' is a self-attention: cross-attention is 'mha'")
