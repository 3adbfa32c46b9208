"""``attn_qk_norm``: per self-attention layer that projects ``q_DNH``/``k_DKH``, the largest
over heads of ``|W_q,n|_F |W_k,n|_F x attn_scale`` (head ``n`` reads key head ``n // G``),
the bound levanter's attention-instability callback watches beside the measured logit:
``|logit| <= |x_t| |x_s| |W_q,n|_2 |W_k,n|_2 scale``, and Frobenius norms bound the spectral
ones. From the parameters before the step's update; the largest over a log line's steps.
With QK-norm the logits are bounded by the norms' scales instead, not by this product.

Layers are ordered encoder then decoder, prefix then repeated layers, a hybrid block's
layers in block order; layers without such projections (recurrent mixers, MLA) are absent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric
from attnlab.metrics.groups import path_names
from attnlab.ops.precision import wide

_STACKS = ("encoder", "decoder")
_SEGMENTS = ("prefix", "layers")


def qk_pairs(params) -> list[tuple[tuple, int | None]]:
    """``[(path to the attn module, block index or None)]`` per segment of each stack, in
    layer order; each holds ``q_DNH``/``k_DKH`` with a leading repeat axis."""
    found = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = path_names(path)
        if names[-1] != "q_DNH" or "attn" not in names or names[0] not in _STACKS:
            continue
        found[names[:-1]] = True
    order = []
    for stack in _STACKS:
        for segment in _SEGMENTS:
            here = [p for p in found if p[:2] == (stack, segment)]
            block = lambda p: int(p[3]) if len(p) > 3 and p[2] == "blocks" else -1
            order += sorted(here, key=block)
    return order


def _at(params, names):
    """The array at ``names`` in a parameter state (abstract or concrete)."""
    x = params
    for n in names:
        x = x[n] if n in x else x[int(n)]
    return jax.tree.leaves(x)[0]


def head_products(q_RDNH, k_RDKH, scale):
    """``[R]``: per repeat, the largest per-head Frobenius-norm product times ``scale``
    (float32, float64 for float64 weights)."""
    f = wide(q_RDNH, k_RDKH)
    q_RN = jnp.sqrt(jnp.sum(jnp.square(q_RDNH.astype(f)), axis=(1, 3)))
    k_RK = jnp.sqrt(jnp.sum(jnp.square(k_RDKH.astype(f)), axis=(1, 3)))
    G = q_RN.shape[1] // k_RK.shape[1]
    return jnp.max(q_RN * jnp.repeat(k_RK, G, axis=1), axis=1) * scale


@register_metric("attn_qk_norm")
class AttnQKNorm(Metric):
    phase = "update"
    reduce = "max"

    def shape(self, mcfg):
        pairs = qk_pairs(self.abstract_params)
        return (sum(int(_at(self.abstract_params, p + ("q_DNH",)).shape[0]) for p in pairs),)

    def value(self, view):
        params, per_segment = view.params, {}
        for p in qk_pairs(params):
            q, k = _at(params, p + ("q_DNH",)), _at(params, p + ("k_DKH",))
            out = head_products(q, k, self.mcfg.attn_scale)
            per_segment.setdefault(p[:2], []).append(out)  # one per block of a period
        layers = []
        for blocks in per_segment.values():  # [R] per block -> r-major, block-minor
            layers.append(jnp.stack(blocks, axis=1).reshape(-1))
        return jnp.concatenate(layers)
