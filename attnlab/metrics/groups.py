"""Parameter groups for the per-group norms: each parameter's group from its path."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from attnlab.metrics.base import Metric
from attnlab.ops.precision import wide

# (group, test on the path's names), first match wins.
GROUPS = (
    ("embed", lambda names: names[0] == "embed"),
    ("head", lambda names: names[0] == "head"),
    ("mtp", lambda names: names[0] == "mtp"),
    ("norm", lambda names: any("norm" in n for n in names)),
    ("attn", lambda names: "attn" in names or "cross_attn" in names),
    ("ffn", lambda names: "ffn" in names),
)


def path_names(path) -> tuple[str, ...]:
    """A leaf's path as names (dict keys, list indices), the Variable's own step dropped."""
    names = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            names.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            names.append(str(k.idx))
    return tuple(names)


def group_of(path) -> str:
    names = path_names(path)
    return next((g for g, test in GROUPS if test(names)), "other")


def group_names(params) -> tuple[str, ...]:
    """The groups present in ``params`` (abstract or concrete), in ``GROUPS`` order."""
    present = {group_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    order = [g for g, _ in GROUPS] + ["other"]
    return tuple(g for g in order if g in present)


def group_norms(tree, groups) -> dict:
    """``{group: L2 norm of the group's leaves}`` (float32, float64 for float64 leaves)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    dtype = wide(*(x for _, x in leaves))
    squares = dict.fromkeys(groups, jnp.zeros((), dtype))
    for path, x in leaves:
        g = group_of(path)
        squares[g] = squares[g] + jnp.sum(jnp.square(x.astype(dtype)))
    return {g: jnp.sqrt(s) for g, s in squares.items()}


class GroupNorms(Metric):
    """Per parameter group, the L2 norm of one tree of the update phase (``of``: the
    ``StepView`` field, ``"grads"`` or ``"updates"``), averaged over the steps of a log line."""

    phase = "update"
    reduce = "mean"
    of: ClassVar[str]

    def shape(self, mcfg):
        return dict.fromkeys(group_names(self.abstract_params), ())

    def value(self, view):
        return group_norms(getattr(view, self.of), group_names(self.abstract_params)), 1.0
