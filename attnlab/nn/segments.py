"""Applying a stack's layers: each segment (``attnlab.config.layer_kinds.Segment``) scanned over its
repeats or unrolled, the cache entries carried through.

A segment's unit is one ``Block`` (a segment of one kind: a plain stack) or a ``Period``
(the P blocks of one repeat of a hybrid block), its parameters stacked on a leading repeat
axis (``stacked``). The scan's body applies one unit: its P layers in order, each with its
own data (index, window, RoPE base, cross-attention K/V, its mixers' cache ordinals), so
the traced program holds P layers whatever the depth; ``ModelConfig.remat`` rematerialises
each unit in the backward pass. Each mixer reads and writes its cache entries through a
``LayerCache`` view that names them by role (``"keys"``), whatever the cache calls them
(``"mla.latent"``, see ``attnlab.config.layer_kinds``): a mixer never sees another's entries.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab import kv_cache, ops
from attnlab.config.layer_kinds import Segment, StackPlan
from attnlab.contracts.mixer import MixerCall
from attnlab.devices.sharding import constrain
from attnlab.kv_cache import LayerCache
from attnlab.nn import probe
from attnlab.nn.blocks import Block
from attnlab.ops.linear import fold

NO_WINDOW = jnp.iinfo(jnp.int32).max  # a layer's window when it attends to everything
REMAT_POLICIES = {
    "full": None,  # save nothing but the layer's inputs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the weight matmuls
}


class Period(nnx.Module):
    """The P layers of one repeat of a hybrid block, applied in order."""

    def __init__(self, cfg, kinds, *, cross: bool, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(cfg, kind=k, cross=cross, rngs=rngs) for k in kinds])


def unit(cfg, segment: Segment, cross: bool):
    """``rngs -> module``: one repeat of ``segment`` (a ``Block`` or a ``Period``)."""
    if len(segment.kinds) == 1:
        return lambda r: Block(cfg, kind=segment.kinds[0], cross=cross, rngs=r)
    return lambda r: Period(cfg, segment.kinds, cross=cross, rngs=r)


def unstacked(layers, n: int):
    """``n`` separate units sliced from a stacked one."""
    graphdef, params = nnx.split(layers)
    return nnx.List(
        [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], params)) for i in range(n)]
    )


@dataclasses.dataclass(frozen=True)
class Layers:
    """How one call applies the layers: the plan, the body's shared inputs and settings."""

    cfg: Any
    plan: StackPlan
    shared: Any  # stack._Shared
    rope_thetas: tuple
    ropes: tuple  # each layer's (base, scaling): ``ModelConfig.layer_ropes``
    windows: tuple
    enc_BSD: Any
    key: Any
    return_weights: bool
    collect: tuple = ()  # named per-layer statistics to return (``layer_statistics``)

    def data(self, segment: Segment, cache):
        """The scan's data beside the parameters, ``[R, P, ...]``: index, window, RoPE
        base, cross K/V and each mixer's cache ordinal (NumPy: static when unrolled)."""
        R, P = segment.repeats, len(segment.kinds)
        index_RP = segment.first + np.arange(R * P, dtype=np.int32).reshape(R, P)
        window_RP = np.array([NO_WINDOW if w is None else w for w in self.windows], np.int32)
        window_RP = window_RP[index_RP]
        rope_RP = None
        options = self.rope_options
        if options is not None and len(options) > 1:  # indices into the (base, scaling) options
            rope_RP = np.array([options.index(r) for r in self.ropes], np.int32)[index_RP]
        elif options is None and len(set(self.rope_thetas)) > 1:
            rope_RP = np.array(self.rope_thetas, np.float32)[index_RP]
        cross = None
        if cache is not None and cache.cross is not None:
            at = lambda c: jnp.take(c, jnp.asarray(index_RP.reshape(-1)), axis=0)
            split_RP = lambda c: c.reshape(R, P, *c.shape[1:])
            cross = tuple(split_RP(at(cache.cross[n])) for n in ("keys", "values"))
        M = max(len(k.mixers) for k in segment.kinds)
        ordinal_RPM = np.zeros((R, P, M), np.int32)
        for (r, p), layer in np.ndenumerate(index_RP):
            for m, (_, ordinal) in enumerate(self.plan.slots[layer]):
                ordinal_RPM[r, p, m] = ordinal
        rope_RP = None if rope_RP is None else jnp.asarray(rope_RP)
        return (jnp.asarray(index_RP), jnp.asarray(window_RP), rope_RP, cross, ordinal_RPM)

    @property
    def rope_options(self) -> tuple | None:
        """With a scaling or a NoPE layer, the distinct ``(base, scaling)`` pairs each layer
        picks from by index (``ops.RopeChoice``; NoPE ``(None, None)``); None when every
        layer rotates unscaled."""
        if all(theta is not None and scaling is None for theta, scaling in self.ropes):
            return None
        return tuple(dict.fromkeys(self.ropes))

    def layer_rope(self, per_layer):
        """What a layer's mixer gets as ``MixerCall.rope_theta`` from its per-layer datum."""
        if self.rope_options is not None:
            return ops.RopeChoice(0 if per_layer is None else per_layer, self.rope_options)
        return self.rope_thetas[0] if per_layer is None else per_layer

    def names(self, segment: Segment):
        """Per position, per mixer: role -> the cache's name of the entry."""
        first = self.plan.slots[segment.first : segment.first + len(segment.kinds)]
        return tuple(tuple(self.plan.names(g, self.cfg) for g, _ in layer) for layer in first)

    def body(self, segment: Segment, ordinal_RPM):
        """One unit as a function of ``(graphdef, r, (x, entries), data)``, remat applied:
        ``r`` the repeat when unrolled (its ordinals static, from ``ordinal_RPM``), None
        when scanned (its ordinals in the data)."""
        names = self.names(segment)

        def apply(graphdef, r, carry, xs):
            x_BTD, entries = carry
            params, index_P, window_P, theta_P, cross_P, ordinal_PM = xs
            if r is not None:
                ordinal_PM = ordinal_RPM[r]
            module = nnx.merge(graphdef, params)
            blocks = module.blocks if isinstance(module, Period) else (module,)
            weights, aux, stats = [], [], []
            with probe.frame() as kept:  # the named intermediates a probe keeps
                for p, block in enumerate(blocks):
                    at = lambda a, p=p: None if a is None else a[p]
                    cross_kv = None if cross_P is None else tuple(c[p] for c in cross_P)
                    with probe.layer(self.layers_at(segment, r, p), index_P[p]):
                        x_BTD, entries, w, a, s = self.layer(
                            block, x_BTD, entries, names[p], index_P[p], window_P[p],
                            at(theta_P), cross_kv, ordinal_PM[p],
                        )  # fmt: skip
                    weights.append(w)
                    aux.append(a)
                    stats.append(s)
            out = (stack_layers(weights), stack_aux(aux), stack_layers(stats), kept)
            return (x_BTD, entries), out

        if self.cfg.remat == "none":
            return apply
        return jax.checkpoint(
            apply,
            policy=REMAT_POLICIES[self.cfg.remat],
            prevent_cse=not self.cfg.scan_layers,
            static_argnums=(0, 1),
        )

    @staticmethod
    def layers_at(segment: Segment, r, p):
        """The layers position ``p`` of a unit stands for: repeat ``r``'s, or every repeat's
        when scanned (``r`` None)."""
        P = len(segment.kinds)
        repeats = range(segment.repeats) if r is None else (r,)
        return tuple(segment.first + i * P + p for i in repeats)

    def layer(self, block, x_BTD, entries, names, index, window, theta, cross_kv, ordinals):
        """One layer: its call, its mixers' cache views, the entries they wrote."""
        s = self.shared
        layer_mask = s.mask.with_window(window) if s.context else s.mask
        if s.per_layer_window:
            layer_mask = s.mask.replace(window=window)
        views = None
        if entries is not None:
            views = tuple(self.view(entries, n, ordinals[m]) for m, n in enumerate(names))
        call = MixerCall(
            positions_BT=s.positions_BT,
            mask=layer_mask,
            bias=s.bias,
            rope_theta=self.layer_rope(theta),
            key=fold(self.key, index),
            layer=index,
            return_weights=self.return_weights,
            collect=self.collect,
        )
        if cross_kv is not None:
            cross_kv = tuple(jnp.swapaxes(c, 1, 2) for c in cross_kv)  # [B, S, K, H]
        apply = lambda blk, *a, **k: blk(*a, **k)
        if self.collect:  # what the block's mixers sow (``nnx.Intermediate``)
            apply = nnx.capture(apply, nnx.Intermediate)
        out = apply(
            block, x_BTD, call, caches=views, enc_BSD=self.enc_BSD, cross_mask=s.cross_mask,
            cross_kv=cross_kv,
        )  # fmt: skip
        (x_BTD, views, weights, aux), sown = out if self.collect else (out, None)
        x_BTD = constrain(x_BTD, "batch", "length", "act_embed")  # the residual stream
        stats = layer_statistics(self.collect, sown, x_BTD) if self.collect else None
        if entries is not None:
            entries = dict(entries)
            for m, view in enumerate(views):
                for role, name in names[m].items():
                    entries[name] = self.written(entries[name], view.layers[role], ordinals[m])
        return x_BTD, entries, weights, aux, stats

    def view(self, entries, names, ordinal):
        """A mixer's ``LayerCache``: its entries by role, at its ordinal (a split cache:
        that layer's own ``[1, B, ...]`` arrays, at index 0)."""
        cache, s = self.shared.cache, self.shared
        axes = dict(cache.slot_axes)
        split = isinstance(next(iter(entries.values())), tuple)
        if split:
            layers = {role: entries[name][int(ordinal)] for role, name in names.items()}
            ordinal = 0
        else:
            layers = {role: entries[name] for role, name in names.items()}
        slot_axes = tuple((role, axes[name]) for role, name in names.items())
        return LayerCache(layers, ordinal, cache.lengths, s.count_B, s.ring, slot_axes)

    @staticmethod
    def written(old, new, ordinal):
        if isinstance(old, tuple):  # a split cache: replace that layer's array
            i = int(ordinal)
            return old[:i] + (new,) + old[i + 1 :]
        return new

    def run(self, segment: Segment, layers, x_BTD, entries, cache):
        """Applies ``segment``'s layers (the stack's ``layers``: stacked, or separate
        units after ``Stack.unstack``): scanned over the repeats, or unrolled."""
        data = self.data(segment, cache)
        body = self.body(segment, data[-1])
        split = entries is not None and isinstance(next(iter(entries.values())), tuple)
        if isinstance(layers, nnx.List):  # separate units (see ``Stack.unstack``)
            params, unit_params = None, [nnx.state(u) for u in layers]
            graphdef = nnx.graphdef(layers[0])
        else:
            params, unit_params = nnx.state(layers), None
            graphdef = nnx.graphdef(layers)
        if unit_params is None and self.cfg.scan_layers:
            body = functools.partial(body, graphdef, None)
            if split:  # the scan needs the layers stacked again
                entries = {n: jnp.concatenate(a) for n, a in entries.items()}
            data = jax.tree.map(jnp.asarray, data)
            (x_BTD, entries), out = probe.scan(
                body, (x_BTD, entries), (params,) + data, len(segment.kinds)
            )
            if split:
                entries = {n: kv_cache.layer_arrays(a) for n, a in entries.items()}
            return x_BTD, entries, out
        outs = []
        for r in range(segment.repeats):
            xs = jax.tree.map(lambda a, r=r: a[r], data)
            p = unit_params[r] if params is None else jax.tree.map(lambda a, r=r: a[r], params)
            (x_BTD, entries), (*out, kept) = body(graphdef, r, (x_BTD, entries), (p,) + xs)
            probe.collect(kept, len(segment.kinds), repeat=r)
            outs.append(tuple(out))
        return x_BTD, entries, jax.tree.map(lambda *o: jnp.stack(o), *outs)


ATTENTION_STATISTICS = ("max_logit", "entropy_sum", "first_sum", "rows")
COLLECTABLE = ("attention", "residual", "indexer_kl")  # what ``Stack(collect=...)`` accepts


def layer_statistics(collect, sown, x_BTD) -> dict:
    """One layer's named statistics, scalars reduced inside the layer: ``"attention"``, its
    first mixer's score statistics (``ops.attention_statistics``; NaN for a layer whose
    mixers compute none), and ``"residual"``, the stream after the layer (the sum of
    squares, the element count and the largest absolute value, float32), and
    ``"indexer_kl"``, a sparse-attention indexer's loss (``{"kl_sum", "rows"}``, zeros for
    a layer without one: ``attnlab.nn.mixers.sparse``)."""
    out = {}
    sown_by = lambda name: [
        v.get_value()[0] for path, v in nnx.to_flat_state(sown) if path and path[-1] == name
    ]
    if "attention" in collect:
        found = sown_by("attention")
        nan = jnp.full((), jnp.nan, jnp.float32)
        out["attention"] = found[0] if found else dict.fromkeys(ATTENTION_STATISTICS, nan)
    if "indexer_kl" in collect:
        found = sown_by("indexer_kl")
        zero = jnp.zeros((), jnp.float32)
        out["indexer_kl"] = found[0] if found else {"kl_sum": zero, "rows": zero}
    if "residual" in collect:
        x = x_BTD.astype(jnp.float32)
        out["residual"] = {
            "sq_sum": jnp.sum(x * x),
            "count": jnp.asarray(x.size, jnp.float32),
            "max_abs": jnp.max(jnp.abs(x)),
        }
    return out


def stack_layers(per_layer):
    """Per-layer outputs (weights) stacked on a new leading axis; None stays None."""
    if per_layer[0] is None:
        return None
    return jax.tree.map(lambda *a: jnp.stack(a), *per_layer)


def stack_aux(per_layer):
    """The FFNs' reports of the layers that report, stacked on a layer axis; where their
    reports differ in form (two FFN variants), only their ``loss``."""
    reports = [a for a in per_layer if a]
    if not reports:
        return {}
    forms = {jax.tree.structure(a) for a in reports}
    shapes = {tuple(np.shape(x) for x in jax.tree.leaves(a)) for a in reports}
    if len(forms) > 1 or len(shapes) > 1:
        reports = [{"loss": a["loss"]} for a in reports]
    return jax.tree.map(lambda *a: jnp.stack(a), *reports)


def flat_layers(tree):
    """``[R, P, ...]`` outputs of a segment as ``[R * P, ...]`` (layer order)."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), tree)


def join(a, b):
    """Two segments' per-layer outputs joined along the layer axis."""
    if a is None or (isinstance(a, dict) and not a):
        return b
    if b is None or (isinstance(b, dict) and not b):
        return a
    if jax.tree.structure(a) != jax.tree.structure(b):  # two FFN variants' reports
        a, b = {"loss": a["loss"]}, {"loss": b["loss"]}
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y]), a, b)
