"""Transformer blocks: a self-attention variant, optional cross-attention and an FFN.

A ``Block`` is one layer of a kind (``attnlab.config.layer_kinds.LayerKind``; by default the
config's): its sequence mixer (a registered ``attnlab.contracts.mixer`` variant, or several side by
side on the same input, their outputs summed: ``attn`` is then a list), optional
cross-attention and a feed-forward network (a registered ``attnlab.contracts.ffn`` variant), each
a residual sub-layer in pre-norm (``x + f(norm(x))``), post-norm (``norm(x + f(x))``),
sandwich (``x + norm2(f(norm1(x)))``, Gemma 2/3) or output (``x + norm(f(x))``, OLMo 2)
placement. ``attnlab.nn.stack`` stacks them.

Named intermediates (``attnlab.nn.probe``): ``resid_pre``, ``resid_mid`` (after the mixers),
``resid_cross`` (after cross-attention), ``resid_post``, and each sub-layer's output
``attn.out`` (``attn.{m}.out`` with several mixers), ``cross_attn.out``, ``ffn.out``;
what the mixers and the FFN name sits under ``attn.``, ``cross_attn.`` and ``ffn.``.
"""

from __future__ import annotations

import jax
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.config.layer_kinds import LayerKind
from attnlab.contracts.ffn import get_ffn
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.nn import probe
from attnlab.nn.layers import Norm
from attnlab.nn.mixers.mha import Attention
from attnlab.nn.parametrization import residual_multiplier
from attnlab.ops.linear import dropout, fold


def stacked(make, n: int, rngs: nnx.Rngs):
    """``n`` modules ``make(rngs)`` as one module whose parameters have a leading axis."""
    keys = jax.random.split(rngs.params(), n)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    state = jax.vmap(lambda key: nnx.state(make(nnx.Rngs(params=key))))(keys)
    return nnx.merge(graphdef, state)


class Block(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, *, kind: LayerKind | None = None, cross: bool = False,
        rngs: nnx.Rngs,
    ):  # fmt: skip
        kind = (kind or LayerKind()).resolved(cfg)
        D = cfg.d_model
        self.placement = cfg.norm_placement
        self.rate = cfg.dropout
        # each residual branch's multiplier (CompleteP's base_depth / n_layers; 1.0: none)
        self.branch_scale = residual_multiplier(cfg)
        self.attn_norm = Norm(cfg, D, rngs=rngs)
        sandwich = cfg.norm_placement == "sandwich"
        self.attn_post_norm = Norm(cfg, D, rngs=rngs) if sandwich else None
        self.ffn_post_norm = Norm(cfg, D, rngs=rngs) if sandwich else None
        mixers = [get_mixer(m.mixer)(cfg, m.mixer_settings, rngs=rngs) for m in kind.mixers]
        self.attn = mixers[0] if len(mixers) == 1 else nnx.List(mixers)
        self.cross_norm = Norm(cfg, D, rngs=rngs) if cross else None
        self.cross_attn = Attention(cfg, cross=True, rngs=rngs) if cross else None
        self.ffn_norm = Norm(cfg, D, rngs=rngs)
        self.ffn = get_ffn(kind.ffn_variant)(cfg, kind.ffn_settings, rngs=rngs)

    def _residual(self, x, norm, fn, key, post_norm=None):
        """One residual sub-layer in the configured placement (``ModelConfig.norm_placement``:
        pre, post, sandwich with ``post_norm`` on the output, or output), the branch times
        ``branch_scale``."""
        scaled = lambda y: y if self.branch_scale == 1.0 else y * self.branch_scale
        if self.placement == "post":
            y, *rest = fn(x)
            return norm(x + dropout(scaled(y), self.rate, key)), rest
        if self.placement == "output":
            y, *rest = fn(x)
            return x + dropout(scaled(norm(y)), self.rate, key), rest
        y, *rest = fn(norm(x))
        if post_norm is not None:
            y = post_norm(y)
        return x + dropout(scaled(y), self.rate, key), rest

    @property
    def mixers(self) -> tuple:
        """The sequence mixers, summed when several."""
        return tuple(self.attn) if isinstance(self.attn, nnx.List) else (self.attn,)

    def mix(self, h_BTD, call: MixerCall, caches=None):
        """The mixers' outputs summed: ``(out_BTD, caches, weights)``, a cache and weights
        per mixer (``caches``: one ``LayerCache`` per mixer, or None)."""
        mixers = self.mixers
        caches = (call.cache,) * len(mixers) if caches is None else caches
        out, new, weights = None, [], []
        for m, (mixer, cache) in enumerate(zip(mixers, caches, strict=True)):
            key = fold(call.key, 0) if m == 0 else fold(call.key, 10 + m)
            with probe.scope("attn" if len(mixers) == 1 else f"attn.{m}"):
                y_BTD, cache, w = mixer(h_BTD, call.replace(key=key, cache=cache))
                y_BTD = probe.tap("out", y_BTD)
            out = y_BTD if out is None else out + y_BTD
            new.append(cache)
            weights.append(w)
        return out, tuple(new), weights[0] if len(mixers) == 1 else tuple(weights)

    def __call__(
        self, x_BTD, call: MixerCall, *, caches=None, enc_BSD=None, cross_mask=None, cross_kv=None
    ):
        """Returns ``(x_BTD, cache, weights, aux)``; ``weights`` is a dict or None, ``aux``
        what the FFN reports (``attnlab.contracts.ffn``; empty for the plain FFN).

        ``call`` is the self-attention's (``MixerCall``); ``caches`` one ``LayerCache`` per
        mixer (then ``cache`` is a tuple of them too; else ``call.cache`` and the mixer's
        cache). Cross-attention attends over ``enc_BSD``, or its keys and values
        ``cross_kv`` computed once, under ``cross_mask``.
        """
        key = call.key
        x_BTD = probe.tap("resid_pre", x_BTD)
        x_BTD, (cache, w_self) = self._residual(
            x_BTD,
            self.attn_norm,
            lambda h: self.mix(h, call, caches),
            fold(key, 1),
            self.attn_post_norm,
        )
        x_BTD = probe.tap("resid_mid", x_BTD)
        cache = cache if caches is not None else cache[0]
        weights = {"self": w_self} if call.return_weights else None
        if self.cross_attn is not None:
            cross_call = MixerCall(
                positions_BT=call.positions_BT,
                mask=cross_mask,
                key=fold(key, 2),
                return_weights=call.return_weights,
            )
            with probe.scope("cross_attn"):
                x_BTD, (w_cross,) = self._residual(
                    x_BTD, self.cross_norm, lambda h: self._cross(h, cross_call, enc_BSD, cross_kv),
                    fold(key, 3),
                )  # fmt: skip
            x_BTD = probe.tap("resid_cross", x_BTD)
            if call.return_weights:
                weights["cross"] = w_cross
        with probe.scope("ffn"):
            x_BTD, (aux,) = self._residual(
                x_BTD,
                self.ffn_norm,
                lambda h: self._ffn(h, fold(key, 4)),
                fold(key, 5),
                self.ffn_post_norm,
            )
        return probe.tap("resid_post", x_BTD), cache, weights, aux

    def _cross(self, h_BTD, call, enc_BSD, cross_kv):
        out_BTD, w = self.cross_attn.cross_attend(h_BTD, call, kv_BSD=enc_BSD, kv=cross_kv)
        return probe.tap("out", out_BTD), w

    def _ffn(self, h_BTD, key):
        out = self.ffn(h_BTD, key=key)
        out, aux = out if isinstance(out, tuple) else (out, {})
        return probe.tap("out", out), aux
