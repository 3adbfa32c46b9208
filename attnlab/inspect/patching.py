"""Patches (replace, add, zero, mean-ablate a named intermediate) and the activation-patching
sweep over layers x positions or layers x heads, with its table and heat map.

The sweep follows the usual "denoising" design: run the clean input and keep an
intermediate at every layer, then run the corrupted input once per cell with that one
layer's intermediate, at one position (or head), replaced by the clean value, and score the
patched logits with ``metric``. All cells run as one batched (``vmap``) call of one compiled
program: the layer and the position are traced.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from matplotlib.figure import Figure

from attnlab.errors import InspectError
from attnlab.inspect.capture import _as_names, _call, _split_kwargs, model_of, one_line_errors, run
from attnlab.nn.probe import Patch, Probe


def _indices(x):
    return None if x is None else jnp.asarray(x, jnp.int32)


def replace(name: str, value, *, heads=None, positions=None, where=None, layer=None) -> Patch:
    """Replaces the intermediates matching ``name`` by ``value`` (their shape, or one that
    broadcasts to it), at ``heads``/``positions``/``where`` only when given."""
    return Patch(name, "replace", jnp.asarray(value), where, _indices(layer), _indices(heads),
                 _indices(positions))  # fmt: skip


def add(name: str, value, *, heads=None, positions=None, where=None, layer=None) -> Patch:
    """Adds ``value`` (broadcast: a steering vector ``[D]``) to the matching intermediates."""
    return Patch(name, "add", jnp.asarray(value), where, _indices(layer), _indices(heads),
                 _indices(positions))  # fmt: skip


def zero(name: str, *, heads=None, positions=None, where=None, layer=None) -> Patch:
    """Zeroes the matching intermediates (``heads=2`` on ``layers.1.attn.z``: ablates a head)."""
    return Patch(name, "zero", None, where, _indices(layer), _indices(heads), _indices(positions))


def mean_ablate(name: str, mean=None, *, heads=None, positions=None, where=None,
                layer=None) -> Patch:  # fmt: skip
    """Replaces the matching intermediates by ``mean`` (e.g. their mean over a reference
    batch, from ``run``), or by their mean over this batch's rows when None."""
    mean = None if mean is None else jnp.asarray(mean)
    return Patch(name, "mean", mean, where, _indices(layer), _indices(heads), _indices(positions))


@dataclasses.dataclass(frozen=True)
class PatchingTable:
    """The result of ``patching_sweep``: ``values[layer, column]`` of the metric with that
    cell patched, the metric on the clean and the corrupted input, and the labels."""

    values: np.ndarray  # [L, X]
    clean: float
    corrupted: float
    name: str
    columns: str  # "position" or "head"
    layers: tuple

    def normalized(self) -> np.ndarray:
        """``(value - corrupted) / (clean - corrupted)``: 1 where patching restores the clean
        metric, 0 where it changes nothing."""
        gap = self.clean - self.corrupted
        if gap == 0:
            raise InspectError(
                "the metric is the same on the clean and the corrupted input, so a patch "
                "cannot restore anything: choose inputs or a metric that differ"
            )
        return (self.values - self.corrupted) / gap

    def best(self) -> tuple[int, int]:
        """``(layer, column)`` of the cell that restores the most of the clean metric."""
        v = self.normalized()
        i, j = np.unravel_index(int(np.argmax(v)), v.shape)
        return int(self.layers[i]), int(j)

    def rows(self) -> list[dict]:
        """One dict per cell: layer, column, value and normalized value."""
        norm = self.normalized()
        return [
            {"layer": int(layer), self.columns: j, "value": float(self.values[i, j]),
             "normalized": float(norm[i, j])}
            for i, layer in enumerate(self.layers)
            for j in range(self.values.shape[1])
        ]  # fmt: skip

    def plot(self, path=None, *, normalized: bool = True, labels=None, title=None) -> Figure:
        """A heat map of the table (layers down, positions or heads across); saved as a PNG
        at ``path`` when given. ``labels``: the columns' labels (e.g. the tokens)."""
        v = self.normalized() if normalized else self.values
        L, X = v.shape
        fig = Figure(figsize=(max(5.5, 0.35 * X + 2), max(2.5, 0.45 * L + 1.5)))
        ax = fig.add_subplot(1, 1, 1)
        bound = float(np.max(np.abs(v))) or 1.0
        im = ax.imshow(v, cmap="RdBu", vmin=-bound, vmax=bound, aspect="auto")
        ax.set_yticks(range(L), [str(i) for i in self.layers])
        ax.set_ylabel("layer")
        ax.set_xlabel(self.columns)
        if labels is not None:
            ax.set_xticks(range(X), [str(t) for t in labels], rotation=90)
        else:
            ax.set_xticks(range(X))
        fig.colorbar(im, ax=ax, label="restored share" if normalized else "metric")
        ax.set_title(title or f"patching {self.name} (clean -> corrupted)")
        fig.tight_layout()
        if path is not None:
            fig.savefig(pathlib.Path(path), dpi=100, bbox_inches="tight")
        return fig


@functools.partial(jax.jit, static_argnames=("graphdef", "name", "columns", "metric", "static"))
def _sweep(graphdef, state, args, kwargs, clean_L, cells, *, name, columns, metric, static):
    model = nnx.merge(graphdef, state)

    def cell(layer_index, layer, column):
        narrow = {"positions" if columns == "position" else "heads": column}
        patch = replace(f"{name}", clean_L[layer_index], layer=layer, **narrow)
        with Probe((), (patch,)) as probe:
            out = _call(model, args, kwargs, static, None)
        probe.check(None)
        return metric(out.logits)

    return jax.vmap(cell)(*cells)


@one_line_errors
def patching_sweep(model, clean, corrupted, metric, *, name: str = "resid_pre",
                   by: str = "position", stack: str = "", **kwargs) -> PatchingTable:  # fmt: skip
    """Activation patching over layers x positions (``by="position"``) or layers x heads
    (``by="head"``, for ``attn.z``/``q``/``k``/``v``).

    ``clean``, ``corrupted``: the model's positional inputs (a tuple, or one array of
    token ids), of the same shape; ``metric``: logits ``[B, T, V]`` -> a scalar (higher:
    more like the clean run), e.g. the logit difference of the right and a wrong answer.
    ``name``: the per-layer intermediate (``"resid_pre"``, ``"attn.out"``, ``"attn.z"``...);
    ``stack``: ``"decoder."`` for an encoder-decoder. Returns a ``PatchingTable``.
    """
    if by not in ("position", "head"):
        raise InspectError(f"by={by!r} is unknown: use 'position' or 'head'")
    clean = clean if isinstance(clean, tuple) else (clean,)
    corrupted = corrupted if isinstance(corrupted, tuple) else (corrupted,)
    full = f"{stack}layers.*.{name}"
    clean_out, acts = run(model, *clean, capture=_as_names(full), **kwargs)
    corrupt_out, _ = run(model, *corrupted, capture=_as_names(full), **kwargs)  # same program
    layers = acts.layers(name, stack)
    clean_L = acts.stack(name, stack)
    axis = 1 if by == "position" else 2
    X = clean_L.shape[1 + axis]
    grid_L, grid_X = np.meshgrid(np.arange(len(layers)), np.arange(X), indexing="ij")
    cells = (
        jnp.asarray(grid_L.reshape(-1), jnp.int32),
        jnp.asarray(np.asarray(layers)[grid_L.reshape(-1)], jnp.int32),
        jnp.asarray(grid_X.reshape(-1), jnp.int32),
    )
    graphdef, state = nnx.split(model_of(model))
    arrays, static = _split_kwargs(kwargs)
    values = _sweep(
        graphdef, state, corrupted, arrays, clean_L, cells, name=full, columns=by,
        metric=metric, static=static,
    )  # fmt: skip
    return PatchingTable(
        values=np.asarray(values, np.float64).reshape(len(layers), X),
        clean=float(metric(clean_out.logits)),
        corrupted=float(metric(corrupt_out.logits)),
        name=f"{stack}{name}",
        columns=by,
        layers=tuple(layers),
    )
