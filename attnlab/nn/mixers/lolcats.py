"""LoLCATs attention (Zhang et al. 2024), ``mixer="lolcats"``: softmax attention over a
sliding window of the last ``window`` tokens plus linear attention with a learned
Hedgehog feature map over the older ones, mixed by a learned factor per head
(``attnlab.ops.lolcats`` holds the equations).

It is softmax attention's layer with three parameters more, so a trained attention layer
becomes one by surgery with ``init="matching"``: ``q_DNH``, ``k_DKH``, ``v_DKH``,
``o_NHD`` (and biases, QK-norm) keep their names and are copied; RoPE, QK-norm and GQA
work as in ``mha``. The new parameters, the ones attention transfer trains, are
``feature_q_NHF`` and ``feature_k_NHF`` (the feature maps of q and k, per query head,
the identity at ``F = H``) and ``window_factor_N`` (the mixing factor's logit,
``g = sigmoid``). ``window=0`` is linear attention with the learned map alone.

Cache, all fixed-size: ``"window_keys"`` and ``"window_values"`` ``[W, K, H]`` (the last
``W`` keys after RoPE and values; a decode step rolls them by one) in the cache's dtype,
and the linear part's ``"state"`` ``[N, 2F, H]`` and ``"normalizer"`` ``[N, 2F]`` in
float32. Tokens that are not real (past a row's count in a prefill) change nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import CacheEntry, MixerCall, MixerSettings, register_mixer
from attnlab.errors import ConfigError
from attnlab.nn import probe
from attnlab.nn.mixers.mha import Attention
from attnlab.nn.mixers.recurrent import token_validity
from attnlab.ops import lolcats

NEW_PARAMS = ("feature_q_NHF", "feature_k_NHF", "window_factor_N")


@register_mixer("lolcats")
class Lolcats(Attention):
    """Sliding-window softmax + learned-feature-map linear attention (module docstring)."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        window: int = 64  # W: tokens of softmax attention (0: linear attention only)
        feature_dim: int = 0  # F of the feature map (2F features out); 0: head_dim
        factor_init: float = 0.0  # the window factor's logit at initialisation (g = 0.5)

        def validate(self, cfg) -> None:
            if cfg.arch != "decoder":
                raise ConfigError(
                    f"ModelConfig.arch={cfg.arch!r} is invalid with mixer='lolcats': the "
                    "layer is causal and decodes from its carried state; use arch='decoder'"
                )
            for name in ("window", "feature_dim"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    self.fail(name, "an int >= 0")
            f = self.factor_init
            if isinstance(f, bool) or not isinstance(f, int | float):
                self.fail("factor_init", "a number (the logit of the window factor)")

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        s = settings or self.Settings()
        super().__init__(cfg, s, rngs=rngs)
        self.settings = s
        N, H, pd = cfg.n_heads, cfg.head_dim, jnp.dtype(cfg.param_dtype)
        F = s.feature_dim or H
        if F == H:  # the identity map per head (LoLCATs' initialisation)
            eye = jnp.broadcast_to(jnp.eye(H, dtype=pd), (N, H, H))
            self.feature_q_NHF, self.feature_k_NHF = nnx.Param(eye), nnx.Param(eye + 0)
        else:
            w = lambda: nnx.Param(jax.random.normal(rngs.params(), (N, H, F), pd) * H**-0.5)
            self.feature_q_NHF, self.feature_k_NHF = w(), w()
        self.window_factor_N = nnx.Param(jnp.full((N,), s.factor_init, pd))

    @classmethod
    def cache_entries(cls, cfg, settings):
        s = settings or cls.Settings()
        N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        F2 = 2 * (s.feature_dim or H)
        out = {
            "state": CacheEntry((N, F2, H), "float32", ("act_heads", None, None)),
            "normalizer": CacheEntry((N, F2), "float32", ("act_heads", None)),
        }
        if s.window:
            axes = (None, "act_kv_heads", None)
            out["window_keys"] = CacheEntry((s.window, K, H), axes=axes)
            out["window_values"] = CacheEntry((s.window, K, H), axes=axes)
        return out

    @classmethod
    def inherit(cls, cfg, settings, old, new):
        """Everything of softmax attention's layer is copied by name; nothing more."""
        return {}

    def __call__(self, x_BTD, call: MixerCall):
        s, cfg = self.settings, self.cfg
        B, T, _ = x_BTD.shape
        W, G = s.window, cfg.n_heads // cfg.n_kv_heads
        q_BTNH = probe.tap("q", self.query(x_BTD, call))
        k_BTKH, v_BTKH = self.project_kv(x_BTD, call.positions_BT, call.rope_theta)
        valid_BT = token_validity(call, T)
        cache, state = call.cache, None
        k_BSKH, v_BSKH, valid_BS = k_BTKH, v_BTKH, valid_BT
        q_index_T = jnp.arange(T)
        if cache is not None:
            state = (cache.read("state"), cache.read("normalizer"))
            if W:  # the window's keys first, at positions start - W ... start - 1
                old_k, old_v = cache.read("window_keys"), cache.read("window_values")
                k_BSKH = jnp.concatenate([old_k.astype(k_BTKH.dtype), k_BTKH], axis=1)
                v_BSKH = jnp.concatenate([old_v.astype(v_BTKH.dtype), v_BTKH], axis=1)
                had_BW = (cache.start_B[:, None] - W + jnp.arange(W)[None, :]) >= 0
                valid_BS = jnp.concatenate([had_BW, valid_BT], axis=1)
                q_index_T = W + q_index_T
        heads = lambda x: jnp.repeat(x, G, axis=2) if G > 1 else x
        k_BSNH, v_BSNH = heads(k_BSKH), heads(v_BSKH)
        fq_BTNF = lolcats.feature_map(q_BTNH, self.feature_q_NHF[...])
        fk_BSNF = lolcats.feature_map(k_BSNH, self.feature_k_NHF[...])
        g_N = jax.nn.sigmoid(self.window_factor_N[...].astype(jnp.float32)) * (W > 0)
        out_BTNH = lolcats.attend(
            q_BTNH, k_BSNH, v_BSNH, fq_BTNF, fk_BSNF, g_N, window=W, scale=cfg.attn_scale,
            q_index_T=q_index_T, valid_BS=valid_BS, state=state,
        ).astype(x_BTD.dtype)  # fmt: skip
        if cache is not None:
            cache = self._update(cache, state, k_BSKH, v_BSKH, fk_BSNF, v_BSNH, valid_BS)
        return self.output(probe.tap("z", out_BTNH), x_BTD), cache, None

    def _update(self, cache, state, k_BSKH, v_BSKH, fk_BSNF, v_BSNH, valid_BS):
        """The cache after the call: keys that left the window join the linear state; the
        window rolls by each row's count of real tokens."""
        W = self.settings.window
        count_B = cache.count_B
        S = k_BSKH.shape[1]
        # index i leaves the window when i < count (the window is the last W of W + count)
        leave_BS = (jnp.arange(S)[None, :] < count_B[:, None]) & (
            True if valid_BS is None else valid_BS
        )
        S_BNFH, z_BNF = lolcats.absorb(state, fk_BSNF, v_BSNH, leave_BS)
        cache = cache.put("state", S_BNFH).put("normalizer", z_BNF)
        if W:
            cache = cache.put("window_keys", lolcats.roll_window(k_BSKH, count_B, W))
            cache = cache.put("window_values", lolcats.roll_window(v_BSKH, count_B, W))
        return cache
