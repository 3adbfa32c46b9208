"""Multi-head attention (MHA / GQA / MQA), the built-in variant ``mixer="mha"``, for self- and
cross-attention.

Projections are stored as ``q_DNH``, ``k_DKH``, ``v_DKH`` and ``o_NHD``, so ``head_dim`` is
independent of ``d_model / n_heads``. The module computes q, k, v, applies QK-norm and RoPE
(with the layer's base), appends k and v to its layer of the cache (``"keys"`` and
``"values"``, ``[B, K, S, H]`` per row) when decoding, and calls the score function that
``ModelConfig.attention_fn`` named when the module was built (``attnlab.contracts.score_function``).
It returns ``(out_BTD, cache, weights_BNTS | None)``.

Variants that change one step subclass it and override that step: ``query`` (q from x),
``keys_values`` (k and v, through the cache), ``attend`` (the scores and the weighted sum),
``output`` (the output projection). ``attnlab.nn.mixers`` holds the built-in ones. A
variant that changes the scores passes a ``score_mod`` to ``attend`` (``extra``; see
``attnlab.ops.score_mods``): every attention path, the chunked one, the fused kernels and
the ring and all-gather of a sequence split over the mesh's context axis, runs it, so the
variant needs no kernel of its own (``mixer="fox"``).

Named intermediates (``attnlab.nn.probe``, under the block's ``attn.`` or ``cross_attn.``):
``q`` (after QK-norm and RoPE), ``k`` and ``v`` (after what the cache holds), ``z`` (each
head's output before the output projection), and, read-only, ``scores`` (the scaled,
biased, capped logits, masked keys at -inf) and ``weights``.

Settings: ``softcap`` caps the self-attention logits at ``c * tanh(s / c)`` (Gemma 2) on
every implementation, the chunked one and context parallelism's included (cross-attention
stays uncapped). Variants whose settings subclass ``Attention.Settings`` inherit it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from attnlab import ops
from attnlab.config import ModelConfig
from attnlab.contracts.mixer import (
    SLOTS,
    CacheEntry,
    Mixer,
    MixerCall,
    MixerSettings,
    register_mixer,
)
from attnlab.contracts.score_function import get_attention
from attnlab.devices.sharding import constrain
from attnlab.errors import ConfigError
from attnlab.nn import probe
from attnlab.nn.context_parallel import ContextMask
from attnlab.nn.layers import Norm, normal
from attnlab.ops.linear import add_bias, dense
from attnlab.ops.scores import attention_scores


@register_mixer("mha")
class Attention(Mixer):
    """Softmax attention with K <= N key/value heads (MHA, GQA, MQA)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        softcap: float | None = None  # c of the logit cap c * tanh(s / c); None: no cap

        def validate(self, cfg) -> None:
            cap = self.softcap
            number = isinstance(cap, int | float) and not isinstance(cap, bool)
            if cap is not None and not (number and 0 < cap < float("inf")):
                self.fail("softcap", "a positive number (Gemma 2 uses 50.0), or None")

    context_parallel = True

    def __init__(self, cfg: ModelConfig, settings=None, *, cross: bool = False, rngs: nnx.Rngs):
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        std, pd = cfg.init_std, cfg.param_dtype
        self.init_attend(cfg, settings, cross=cross)
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
        whole = cfg.qk_norm_scope == "projection"  # over all heads at once (OLMo 2)
        q_dim, k_dim = (N * H, K * H) if whole else (H, H)
        self.q_norm = Norm(cfg, q_dim, rngs=rngs, kind="rmsnorm") if use_qk_norm else None
        self.k_norm = Norm(cfg, k_dim, rngs=rngs, kind="rmsnorm") if use_qk_norm else None

    def init_attend(self, cfg: ModelConfig, settings, *, cross: bool = False):
        """What ``attend`` reads besides the parameters: the config, the score function
        (resolved now, so it is part of the graph), the logit cap of mha's settings or a
        variant's built on them (none for cross-attention), and the backend the model is
        built for (the platform ``"auto"`` chooses a path by). A subclass that does not
        call ``Attention.__init__`` calls this."""
        self.cfg = cfg
        self.cross = cross
        self.softcap = getattr(settings, "softcap", None) if not cross else None
        self.attend_fn = get_attention(cfg.attention_fn)
        self.backend = ops.paths.backend()

    @classmethod
    def cache_entries(cls, cfg, settings):
        shape = (cfg.n_kv_heads, SLOTS, cfg.head_dim)
        axes = ("act_kv_heads", None, None)
        return {"keys": CacheEntry(shape, axes=axes), "values": CacheEntry(shape, axes=axes)}

    # The steps a variant may override.

    def _project(self, x, w, b):
        y = dense(x, w[...])
        return y if b is None else add_bias(y, b[...])

    def _qk_norm(self, norm, x_BTNH):
        """QK-norm per head, or over the whole projection (``qk_norm_scope``)."""
        if self.cfg.qk_norm_scope == "head":
            return norm(x_BTNH)
        return norm(x_BTNH.reshape(*x_BTNH.shape[:-2], -1)).reshape(x_BTNH.shape)

    def _rope(self, x, positions, theta):
        if self.cfg.position != "rope" or self.cross:
            return x
        if theta is None:  # called alone: the model's RoPE
            theta = ops.RopeChoice(0, ((self.cfg.rope_theta, self.cfg.rope_scaling),))
        if isinstance(theta, ops.RopeChoice):  # a base with its scaling (the stack's layers)
            return theta(x, positions, rotary_dim=self.cfg.rotary_dim)
        return ops.apply_rope(x, positions, theta=theta, rotary_dim=self.cfg.rotary_dim)

    def query(self, x_BTD, call: MixerCall):
        q_BTNH = self._project(x_BTD, self.q_DNH, self.q_bias_NH)
        if self.q_norm is not None:
            q_BTNH = self._qk_norm(self.q_norm, q_BTNH)
        q_BTNH = self._rope(q_BTNH, call.positions_BT, call.rope_theta)
        return constrain(q_BTNH, "batch", "length", "act_heads", None)

    def project_kv(self, x_BSD, positions_BS=None, rope_theta=None):
        """Keys and values of ``x`` (with k-norm and RoPE when configured)."""
        k_BSKH = self._project(x_BSD, self.k_DKH, self.k_bias_KH)
        v_BSKH = self._project(x_BSD, self.v_DKH, self.v_bias_KH)
        if self.k_norm is not None:
            k_BSKH = self._qk_norm(self.k_norm, k_BSKH)
        return self._rope(k_BSKH, positions_BS, rope_theta), v_BSKH

    def keys_values(self, x_BTD, call: MixerCall):
        """``(cache, k_BSKH, v_BSKH)``: this call's keys and values, after what the cache
        holds when decoding (the cache then holds them too)."""
        k_BTKH, v_BTKH = self.project_kv(x_BTD, call.positions_BT, call.rope_theta)
        cache = call.cache
        if cache is None:
            return None, k_BTKH, v_BTKH
        cache, k_BKSH = cache.append("keys", k_BTKH)
        cache, v_BKSH = cache.append("values", v_BTKH)
        return cache, jnp.swapaxes(k_BKSH, 1, 2), jnp.swapaxes(v_BKSH, 1, 2)

    def attend(self, q_BTNH, k_BSKH, v_BSKH, call: MixerCall, **extra):
        """``(out_BTNH, weights_BNTS | None)`` of the configured score function (``scale``
        in ``extra``: the logit scale, else ``ModelConfig.attn_scale``)."""
        cfg = self.cfg
        scale = extra.pop("scale", cfg.attn_scale)
        dt = q_BTNH.dtype
        k_BSKH, v_BSKH = k_BSKH.astype(dt), v_BSKH.astype(dt)
        key = call.key if cfg.attention_dropout > 0 else None
        probe.record("scores", lambda: attention_scores(
            q_BTNH, k_BSKH, mask=call.mask, bias=call.bias, scale=scale, softcap=self.softcap
        ))  # fmt: skip
        if self.softcap is not None:
            extra = {"softcap": self.softcap, **extra}
        if isinstance(call.mask, ContextMask):  # the sequence is split over the mesh
            other = sorted(set(extra) - {"score_mod", "softcap"})  # the ring takes both
            if other:
                raise ConfigError(
                    f"ModelConfig.mixer_settings {other} are not supported with the "
                    "sequence split over mesh.context > 1: set mesh.context to 1"
                )
            out = call.mask.attend(
                q_BTNH, k_BSKH, v_BSKH, scale=scale,
                dropout_rate=cfg.attention_dropout, dropout_key=key, **extra,
            )  # fmt: skip
            return out, None
        blocks = {
            name: value
            for name, value in (
                ("block_q", cfg.attention_block_q),
                ("block_k", cfg.attention_block_k),
            )
            if value is not None
        }
        result = self.attend_fn(
            q_BTNH,
            k_BSKH,
            v_BSKH,
            mask=call.mask,
            bias=call.bias,
            scale=scale,
            return_weights=call.return_weights,
            implementation=cfg.attention_impl,
            dropout_rate=cfg.attention_dropout,
            dropout_key=key,
            backend=self.backend,
            **blocks,
            **extra,
        )
        return result if call.return_weights else (result, None)

    def output(self, out_BTNH, x_BTD=None):
        out_BTD = dense(out_BTNH, self.o_NHD[...], n_in=2)
        if self.o_bias_D is not None:
            out_BTD = add_bias(out_BTD, self.o_bias_D[...])
        return out_BTD

    def statistics(self, q_BTNH, k_BSKH, call: MixerCall, **extra):
        """This layer's score statistics (``ops.attention_statistics``): scalars."""
        return ops.attention_statistics(
            q_BTNH, k_BSKH, mask=call.mask, bias=call.bias, scale=self.cfg.attn_scale,
            softcap=self.softcap, **extra,
        )  # fmt: skip

    def __call__(self, x_BTD, call: MixerCall):
        q_BTNH = probe.tap("q", self.query(x_BTD, call))
        cache, k_BSKH, v_BSKH = self.keys_values(x_BTD, call)
        if "attention" in call.collect and not isinstance(call.mask, ContextMask):
            self.sow(nnx.Intermediate, "attention", self.statistics(q_BTNH, k_BSKH, call))
        out_BTNH, weights_BNTS = self.attend(
            q_BTNH, probe.tap("k", k_BSKH), probe.tap("v", v_BSKH), probe.weights_call(call)
        )
        probe.record("weights", weights_BNTS)
        return self.output(probe.tap("z", out_BTNH), x_BTD), cache, weights_BNTS

    def cross_attend(self, x_BTD, call: MixerCall, *, kv_BSD=None, kv=None):
        """Cross-attention over ``kv_BSD`` (the encoder output), or its keys and values
        ``kv = (k_BSKH, v_BSKH)`` computed once (``project_kv``)."""
        q_BTNH = probe.tap("q", self.query(x_BTD, call))
        k_BSKH, v_BSKH = kv if kv is not None else self.project_kv(kv_BSD)
        out_BTNH, weights_BNTS = self.attend(
            q_BTNH, probe.tap("k", k_BSKH), probe.tap("v", v_BSKH), probe.weights_call(call)
        )
        probe.record("weights", weights_BNTS)
        return self.output(probe.tap("z", out_BTNH), x_BTD), weights_BNTS
