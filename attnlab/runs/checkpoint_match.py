"""Whether a stored checkpoint's tree (paths, shapes, dtypes, read from orbax's metadata)
matches the restore target, checked before anything is read: the first leaf that differs
raises a ``CheckpointError`` naming it, and a checkpoint of the per-layer layout that came
before stacked layers is refused outright (``attnlab.runs.checkpoint``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from attnlab.errors import CheckpointError

_FIX = (
    "The checkpoint was written by a different model config; "
    "use a new --workdir or the original config."
)


def _abstract_leaf(leaf: Any) -> jax.ShapeDtypeStruct:
    if not hasattr(leaf, "dtype"):
        raise TypeError(f"restore targets need array-like leaves; got {type(leaf).__name__}")
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)


def _describe(shape: Iterable[int], dtype: Any) -> str:
    return f"shape {tuple(shape)} {np.dtype(dtype).name}"


def _check_matches(
    stored: dict[tuple, Any], expected: dict[tuple, jax.ShapeDtypeStruct], where: str
) -> None:
    """Raises CheckpointError at the first leaf whose path, shape or dtype differs."""
    _refuse_per_layer_layout(stored, expected, where)
    for path, want in expected.items():
        name = "/".join(map(str, path))
        want_desc = _describe(want.shape, want.dtype)
        if path not in stored:
            raise CheckpointError(
                f"{where} does not match the restore target: leaf '{name}' is absent from the "
                f"checkpoint (expected {want_desc}). {_FIX}"
            )
        have = stored[path]
        if tuple(have.shape) != tuple(want.shape) or np.dtype(have.dtype) != np.dtype(want.dtype):
            raise CheckpointError(
                f"{where} does not match the restore target: leaf '{name}' is stored with "
                f"{_describe(have.shape, have.dtype)} but the target expects {want_desc}. {_FIX}"
            )
    for path, have in stored.items():
        if path not in expected:
            name = "/".join(map(str, path))
            raise CheckpointError(
                f"{where} does not match the restore target: leaf '{name}' "
                f"({_describe(have.shape, have.dtype)}) is in the checkpoint but not in the "
                f"target. {_FIX}"
            )


def _per_layer(path: tuple) -> bool:
    """A path of the earlier layout: one subtree per layer, ``.../layers/<int>/...``."""
    return any(a == "layers" and str(b).isdigit() for a, b in zip(path[:-1], path[1:], strict=True))


def _refuse_per_layer_layout(stored: dict, expected: dict, where: str) -> None:
    if any(map(_per_layer, stored)) and not any(map(_per_layer, expected)):
        raise CheckpointError(
            f"{where} holds one set of parameters per layer (layers/0, layers/1, ...), the "
            "layout of attnlab before layers were stacked on a leading axis; it cannot be "
            "restored into a stacked model without silently misplacing weights. Train again "
            "in a new --workdir."
        )
