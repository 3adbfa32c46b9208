"""Running a model with a probe: captured intermediates, patches, their cost.

``run`` splits the model once and calls one function jitted per (model graph, captured
names, patch kinds, input shapes), merging the model inside; patch values, layers, heads
and positions are traced arrays, so a sweep over them reuses one compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.errors import InspectError
from attnlab.nn.probe import Patch, Probe, Seen

MAX_BYTES = 1 << 30  # what ``run`` captures at most unless told (1 GiB)


class Captured(Mapping):
    """The captured intermediates of one forward pass: full name -> array.

    ``stack("attn.weights")`` stacks one name over the layers (``[L, ...]``, layer order);
    ``nbytes`` is what they take.
    """

    def __init__(self, values: dict):
        self._values = dict(sorted(values.items(), key=lambda kv: _order(kv[0])))

    def __getitem__(self, name):
        if name not in self._values:
            raise KeyError(_missing(name, self._values))
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __repr__(self):
        return f"Captured({len(self)} names, {self.nbytes:,} bytes)"

    @property
    def nbytes(self) -> int:
        """Bytes of the captured arrays."""
        return int(sum(v.nbytes for v in self._values.values()))

    def layers(self, name: str, stack: str = "") -> list[int]:
        """The layers at which ``name`` (e.g. ``"attn.z"``) was captured, in order."""
        pattern = re.compile(rf"^{re.escape(stack)}layers\.(\d+)\.{re.escape(name)}$")
        return sorted(int(m.group(1)) for k in self._values if (m := pattern.match(k)))

    def stack(self, name: str, stack: str = "") -> jax.Array:
        """``name`` of every captured layer stacked on a leading layer axis (``stack``: the
        prefix of an encoder-decoder's stack, ``"encoder."`` or ``"decoder."``)."""
        layers = self.layers(name, stack)
        if not layers:
            raise KeyError(_missing(f"{stack}layers.*.{name}", self._values))
        return jnp.stack([self._values[f"{stack}layers.{i}.{name}"] for i in layers])


def _order(name):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _missing(name, values):
    from attnlab.nn.probe import unknown_name

    return unknown_name(name, {n: None for n in values}).replace(
        "matches no name of this model", "was not captured"
    )


def one_line_errors(fn):
    """``fn`` re-raising an ``InspectError`` raised while JAX traced it without the note JAX
    appends to the message (so it stays one line)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InspectError as e:
            line = str(e).split("\n", 1)[0]
            if line == str(e):
                raise
            raise InspectError(line) from None

    return wrapper


def model_of(obj):
    """The NNX module of a model, a ``Run`` (``attnlab.load_run``) or a ``Pretrained``."""
    if isinstance(obj, nnx.Module):
        return obj
    model = getattr(obj, "model", None)
    if isinstance(model, nnx.Module):
        return model
    raise InspectError(
        f"expected a model (an nnx.Module), a Run or a Pretrained handle, got {type(obj).__name__}"
    )


def _split_kwargs(kwargs):
    """Keyword arguments holding arrays (traced: arrays, a cache) and the rest (static:
    flags, None)."""
    arrays, static = {}, []
    for k, v in kwargs.items():
        if any(isinstance(x, jax.Array | np.ndarray) for x in jax.tree.leaves(v)):
            arrays[k] = v
        else:
            static.append((k, v))
    return arrays, tuple(static)


def _as_patches(patches) -> tuple:
    if isinstance(patches, Patch):
        patches = (patches,)
    patches = tuple(patches or ())
    for p in patches:
        if not isinstance(p, Patch):
            raise InspectError(
                f"patches: expected attnlab.inspect patches (replace, add, zero, mean_ablate), "
                f"got {type(p).__name__}"
            )
    return patches


def _as_names(capture) -> tuple:
    if isinstance(capture, str):
        return (capture,)
    return tuple(capture or ())


def _call(model, args, kwargs, static_kwargs, method):
    fn = model if method is None else getattr(model, method)
    return fn(*args, **kwargs, **dict(static_kwargs))


@functools.partial(
    jax.jit, static_argnames=("graphdef", "capture", "static_kwargs", "method", "max_bytes")
)
def _forward(graphdef, state, args, kwargs, patches, *, capture, static_kwargs, method,
             max_bytes):  # fmt: skip
    model = nnx.merge(graphdef, state)
    with Probe(capture, patches) as probe:
        out = _call(model, args, kwargs, static_kwargs, method)
    probe.check(max_bytes)
    return out, probe.captured


@one_line_errors
def run(model, *args, capture=(), patches=(), max_bytes: int | None = MAX_BYTES,
        method: str | None = None, **kwargs):  # fmt: skip
    """Runs ``model(*args, **kwargs)`` (or ``model.<method>``) jitted, capturing the named
    intermediates that match ``capture`` (globs: ``"layers.*.attn.weights"``,
    ``"layers.3.resid_post"``) and applying ``patches`` (``replace``, ``add``, ``zero``,
    ``mean_ablate``). Returns ``(output, Captured)``.

    ``model``: an NNX model, a ``Run`` or a ``Pretrained`` handle. Raises an
    ``InspectError`` (before anything runs) for a name that matches nothing (listing the
    close ones), a patch of the wrong shape, or a capture over ``max_bytes`` (None: no limit).
    """
    graphdef, state = nnx.split(model_of(model))
    arrays, static = _split_kwargs(kwargs)
    out, captured = _forward(
        graphdef, state, tuple(args), arrays, _as_patches(patches), capture=_as_names(capture),
        static_kwargs=static, method=method, max_bytes=max_bytes,
    )  # fmt: skip
    return out, Captured(captured)


def _traced(model, args, kwargs, capture, patches, method):
    """The probe of one abstract forward pass (nothing is computed or allocated)."""
    graphdef, state = nnx.split(model_of(model))
    arrays, static = _split_kwargs(kwargs)
    holder = {}

    def fn(state, args, arrays, patches):
        with Probe(capture, patches) as probe:
            out = _call(nnx.merge(graphdef, state), args, arrays, static, method)
        holder["probe"] = probe
        return out, probe.captured

    jax.eval_shape(fn, state, tuple(args), arrays, _as_patches(patches))
    return holder["probe"]


@one_line_errors
def names(model, *args, method: str | None = None, **kwargs) -> dict[str, Seen]:
    """Every named intermediate of ``model`` on these inputs: full name -> ``Seen`` (its
    shape and dtype, None for those computed only when captured; whether it is patchable).
    Traced abstractly: nothing runs."""
    return dict(_traced(model, args, kwargs, ("*",), (), method).seen)


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a capture takes: bytes per captured name and their sum (``total``), which is
    what the compiled forward pass holds for it (under the scanned stack too: a name
    selected at some layers is kept for those layers alone)."""

    per_name: dict
    total: int


@one_line_errors
def cost(model, *args, capture=(), patches=(), method: str | None = None, **kwargs) -> Cost:
    """The bytes ``run(model, *args, capture=capture, patches=patches)`` would capture, from
    shapes alone (``args`` may be ``jax.ShapeDtypeStruct``); raises what ``run`` would.

    Attention weights (``attn.weights``) are ``[B, N, T, S]`` float32 per layer, and asking
    for them runs the reference attention (on the chunked path too; under the scanned stack
    in every layer of the segment, one layer's weights alive at a time), so their cost grows
    as ``T * S``; ``run`` refuses a capture over its ``max_bytes`` with this figure.
    """
    probe = _traced(model, args, kwargs, _as_names(capture), patches, method)
    probe.check(None)
    per = {n: probe.seen[n].nbytes for n in probe.captured}
    return Cost(per, int(sum(per.values())))
