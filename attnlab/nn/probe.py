"""Named intermediates: where the model's code names a value, and the probe that reads or
replaces it while a forward pass is traced (``attnlab.inspect`` is the API over it).

The model's code calls ``tap(name, value)`` at each intermediate that may be read or
patched (the residual stream, q/k/v, the per-head attention output, FFN activations) and
``record(name, value)`` at each that may only be read (scores, weights, a mixer's state,
the router's choices); ``scope(name)`` prefixes the names of what it encloses (``attn``,
``cross_attn``, ``ffn``; ``encoder``/``decoder`` in an encoder-decoder) and the stack's
layer runner opens ``layer(...)`` around each layer, so a value's stable name is
``[stack.]layers.{i}.{scope}.{name}``, e.g. ``layers.3.attn.weights``.

With no probe active (every ordinary call) these return their input and add nothing to
the traced program. A ``Probe`` is active only while ``attnlab.inspect`` traces a forward
pass (``with probe:``), and only at trace time: it decides, per name, whether to keep the
value, replace it, or neither, so what is not selected costs nothing.

Under the scanned layer stack a layer's code is traced once for all the repeats of its
segment: the probe keeps what is selected in a per-call ``frame`` that the scan body
returns, ``scan`` writes it into a carried buffer of the selected repeats alone (or the
scan's stacked outputs when every repeat is selected), and ``collect`` names each row by
its layer; a patch there applies where the traced layer index is the patched layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import fnmatch
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from attnlab.errors import InspectError

_ACTIVE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("probe", default=None)

OPS = ("replace", "add", "zero", "mean")


@struct.dataclass
class Patch:
    """One change to the named intermediates matching ``name`` (a glob such as
    ``layers.3.attn.z`` or ``layers.*.resid_pre``).

    ``op``: ``"replace"`` (by ``value``), ``"add"`` (``value``, broadcast: a steering
    vector), ``"zero"``, or ``"mean"`` (by ``value`` when given, else the batch mean of the
    intermediate). ``where``: a boolean array broadcastable to the intermediate (True: change
    it here; None: everywhere); ``heads`` and ``positions`` (index arrays, traced or not)
    narrow it to those heads (axis 2 of ``q``, ``k``, ``v``, ``z``) and tokens (axis 1).
    ``layer``: a traced layer index restricting the patch to one
    of the layers ``name`` matches (a sweep's one compiled program); None: all of them.
    Build it with ``attnlab.inspect.replace`` / ``add`` / ``zero`` / ``mean_ablate``.
    """

    name: str = struct.field(pytree_node=False)
    op: str = struct.field(pytree_node=False)
    value: Any = None
    where: Any = None
    layer: Any = None
    heads: Any = None  # head indices (the N or K axis of a q/k/v/z name); None: all
    positions: Any = None  # token indices (axis 1); None: all


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the probe learnt of a name while tracing: shape, dtype, whether it is patchable."""

    shape: tuple
    dtype: Any
    patchable: bool

    @property
    def nbytes(self) -> int:
        """Bytes of one such value (0 when its shape is unknown: computed only when asked)."""
        if self.shape is None:  # computed only when captured
            return 0
        return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize


@dataclasses.dataclass
class _Layer:
    candidates: tuple  # the layers this code stands for (one unrolled, R scanned)
    index: Any  # the layer index (traced inside the scan)


class Probe:
    """Keeps the intermediates whose names match ``capture`` (a glob or several) and
    applies ``patches`` (one or several), for one traced forward pass (``with probe:
    model(...)``; then ``probe.captured``, and ``probe.check()`` for names that matched
    nothing)."""

    def __init__(self, capture=(), patches=(), *, weights: bool = True):
        self.patterns = (capture,) if isinstance(capture, str) else tuple(capture)
        self.patches = (patches,) if isinstance(patches, Patch) else tuple(patches)
        for p in self.patches:
            if p.op not in OPS:
                raise InspectError(f"patch op {p.op!r} is unknown: use one of {OPS}")
        self.scopes: list[tuple[str, bool]] = []  # (name, inside a layer)
        self.layer: _Layer | None = None
        self.frames: list[dict] = []
        self.seen: dict[str, Seen] = {}
        self.captured: dict[str, jax.Array] = {}
        self.used: set[str] = set()  # patterns and patch names that matched a name
        self._token = None

    def __enter__(self):
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.reset(self._token)

    # Names -----------------------------------------------------------------------------
    def names_of(self, name) -> list[str]:
        """The full names ``name`` stands for here (one per candidate layer)."""
        prefix = "".join(s + "." for s, inner in self.scopes if not inner)
        local = ".".join([*(s for s, inner in self.scopes if inner), name])
        if self.layer is None:
            return [prefix + local]
        return [f"{prefix}layers.{i}.{local}" for i in self.layer.candidates]

    def _selected(self, full: str) -> bool:
        hits = [p for p in self.patterns if fnmatch.fnmatchcase(full, p)]
        self.used.update(hits)
        return bool(hits)

    def wants(self, name) -> bool:
        """Whether ``name`` here is captured for some layer (trace-time, static)."""
        return any([self._selected(n) for n in self.names_of(name)])

    # Taps ------------------------------------------------------------------------------
    def tap(self, name, value, *, patchable: bool):
        """``value`` (or ``value()``, a lazy value computed only when captured) as the model
        continues with it: patched where a patch names it; kept where ``capture`` does."""
        fulls = self.names_of(name)
        patches = []
        for patch in self.patches:
            hit = [i for i, n in enumerate(fulls) if fnmatch.fnmatchcase(n, patch.name)]
            if hit:
                self.used.add(patch.name)
                if not patchable:
                    raise InspectError(
                        f"{fulls[hit[0]]} is read-only (captured, not patched): patch what it "
                        "is computed from (attn.q, attn.k, attn.z, the residual stream)"
                    )
                patches.append((patch, hit))
        selected = [n for n in fulls if self._selected(n)]
        if callable(value):  # computed only when captured (record's lazy form)
            value = value() if selected else None
        if value is None:
            for n in fulls:
                self.seen.setdefault(n, Seen(None, None, patchable))
            return None
        for n in fulls:
            self.seen[n] = Seen(tuple(value.shape), value.dtype, patchable)
        for patch, hit in patches:
            value = self._patched(patch, value, fulls[hit[0]], hit, len(fulls))
        if selected:
            self._keep(fulls, value)
        return value

    def _keep(self, fulls, value):
        if self.layer is None:
            self.captured[fulls[0]] = value
            return
        # The key: the first layer this code stands for, then the rest of the name.
        first, rest = fulls[0].split("layers.", 1)[1].split(".", 1)
        prefix = fulls[0].split("layers.", 1)[0]
        self.frames[-1][f"{prefix}|{first}|{rest}"] = value

    def _patched(self, patch: Patch, value, full, hit, n_candidates):
        shape = tuple(value.shape)
        new = value
        if patch.op in ("replace", "add", "mean") and patch.value is not None:
            v = jnp.asarray(patch.value)
            try:
                np.broadcast_shapes(tuple(v.shape), shape)
                fits = np.broadcast_shapes(tuple(v.shape), shape) == shape
            except ValueError:
                fits = False
            if not fits:
                raise InspectError(
                    f"patch of {full}: value shape {tuple(v.shape)} does not fit the "
                    f"intermediate's shape {shape}: pass an array of shape {shape} (or one "
                    "that broadcasts to it)"
                )
            v = v.astype(value.dtype)
            v = jnp.broadcast_to(v, shape)
            new = value + v if patch.op == "add" else v
        elif patch.op == "zero":
            new = jnp.zeros_like(value)
        elif patch.op == "mean":
            new = jnp.broadcast_to(jnp.mean(value, axis=0, keepdims=True), shape)
        elif patch.op in ("replace", "add"):
            raise InspectError(f"patch {patch.op!r} of {full} needs a value")
        keep = _narrowed(patch, full, shape)
        if patch.where is not None:
            try:
                np.broadcast_shapes(tuple(jnp.shape(patch.where)), shape)
            except ValueError:
                raise InspectError(
                    f"patch of {full}: where shape {tuple(jnp.shape(patch.where))} does not "
                    f"broadcast to the intermediate's shape {shape}"
                ) from None
            where = jnp.broadcast_to(jnp.asarray(patch.where, bool), shape)
            keep = where if keep is None else jnp.broadcast_to(keep, shape) & where
        if self.layer is not None and (patch.layer is not None or len(hit) < n_candidates):
            layers = np.asarray([self.layer.candidates[i] for i in hit], np.int32)
            here = jnp.isin(self.layer.index, jnp.asarray(layers))
            if patch.layer is not None:
                here = here & (self.layer.index == patch.layer)
            keep = here if keep is None else keep & here
        elif self.layer is None and patch.layer is not None:
            raise InspectError(f"patch of {full}: layer= applies to per-layer names only")
        return new if keep is None else jnp.where(jnp.broadcast_to(keep, shape), new, value)

    # Layers and frames (the stack's layer runner) ----------------------------------------
    def _repeats(self, key: str, period: int, n: int) -> list[int]:
        """The repeats (of ``n``) at which a frame key's name is captured."""
        prefix, first, rest = key.split("|")
        full = lambda r: f"{prefix}layers.{int(first) + r * period}.{rest}"
        return [r for r in range(n) if self._selected(full(r))]

    def collect(self, frame: dict, period: int, repeats=None):
        """Names the values a unit's frame kept: rows of the scan's repeats ``repeats[key]``
        (a key's value for layer ``l`` holds layers ``l + r * period``; None: every repeat,
        stacked), or one unrolled unit's (``repeats`` an int, the repeat)."""
        for key, value in frame.items():
            prefix, first, rest = key.split("|")
            if isinstance(repeats, int):
                rows = {0: None}
            else:
                at = range(value.shape[0]) if repeats is None else repeats[key]
                rows = dict(enumerate(at))
            for j, r in rows.items():
                layer = int(first) + (0 if r is None else r * period)
                full = f"{prefix}layers.{layer}.{rest}"
                if self._selected(full):
                    self.captured[full] = value if r is None else value[j]

    # After the trace -------------------------------------------------------------------
    def check(self, max_bytes: int | None = None):
        """Raises for patterns or patches that matched no name (listing the close ones), and
        for a capture larger than ``max_bytes``."""
        for wanted in (*self.patterns, *(p.name for p in self.patches)):
            if wanted not in self.used:
                raise InspectError(unknown_name(wanted, self.seen))
        if max_bytes is not None:
            need = self.nbytes
            if need > max_bytes:
                raise InspectError(
                    f"capturing {', '.join(self.patterns)} needs {_human(need)} "
                    f"(> max_bytes={_human(max_bytes)}): select fewer names or layers, a "
                    "shorter batch, or raise max_bytes"
                )

    @property
    def nbytes(self) -> int:
        """Bytes the captured values take."""
        return sum(self.seen[n].nbytes for n in self.captured)


HEADED = ("q", "k", "v", "z")  # names whose axis 2 is a head axis ([B, T, N, H], [B, S, K, H])


def _narrowed(patch: Patch, full: str, shape: tuple):
    """The boolean mask of ``patch.heads`` and ``patch.positions`` over an intermediate of
    ``shape`` (None when neither is given)."""
    keep = None
    for indices, axis, what in ((patch.positions, 1, "positions"), (patch.heads, 2, "heads")):
        if indices is None:
            continue
        if len(shape) <= axis or (what == "heads" and full.rsplit(".", 1)[-1] not in HEADED):
            raise InspectError(
                f"patch of {full} (shape {shape}) has no {what} axis: {what}= applies to "
                + ("attn.q, attn.k, attn.v and attn.z" if what == "heads" else "[B, T, ...]")
            )
        at = jnp.atleast_1d(jnp.asarray(indices, jnp.int32))
        hit = jnp.any(jnp.arange(shape[axis], dtype=jnp.int32)[:, None] == at[None, :], axis=1)
        hit = hit.reshape((1,) * axis + (shape[axis],) + (1,) * (len(shape) - axis - 1))
        keep = hit if keep is None else keep & hit
    return keep


def unknown_name(wanted: str, seen: dict) -> str:
    """One line naming an unknown intermediate and the close matches among ``seen``."""
    names = sorted(seen)
    close = difflib.get_close_matches(wanted, names, n=4, cutoff=0.6)
    if not close:  # the same final part at any layer
        tail = wanted.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(tail, sorted({n.rsplit(".", 1)[-1] for n in names}))
        close = [f"*.{c}" for c in close]
    hint = f"close matches: {', '.join(close)}" if close else f"{len(names)} names exist"
    return (
        f"intermediate {wanted!r} matches no name of this model ({hint}); "
        "attnlab.inspect.names(model, ...) lists them"
    )


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# What the model's code calls ------------------------------------------------------------
def active() -> Probe | None:
    """The probe of the forward pass being traced, or None (every ordinary call)."""
    return _ACTIVE.get()


def tap(name: str, value):
    """``value``, kept and/or patched when a probe asks for ``name`` here."""
    probe = _ACTIVE.get()
    return value if probe is None else probe.tap(name, value, patchable=True)


def record(name: str, value: Any | Callable[[], Any]) -> None:
    """Keeps ``value`` (or ``value()``, computed only then) when a probe asks for ``name``."""
    probe = _ACTIVE.get()
    if probe is not None:
        probe.tap(name, value, patchable=False)


def wants(name: str) -> bool:
    """Whether a probe captures ``name`` here (for values computed only when asked)."""
    probe = _ACTIVE.get()
    return probe is not None and probe.wants(name)


def scope(name: str):
    """Prefixes the names tapped inside with ``name.``; a no-op without a probe."""
    probe = _ACTIVE.get()
    if probe is None:
        return contextlib.nullcontext()
    return _scoped(probe, name)


@contextlib.contextmanager
def _scoped(probe, name):
    probe.scopes.append((name, probe.layer is not None))
    try:
        yield
    finally:
        probe.scopes.pop()


def layer(candidates, index):
    """The scope of one layer: ``candidates`` the layer indices its code stands for (static),
    ``index`` the layer's (traced inside the scan)."""
    probe = _ACTIVE.get()
    if probe is None:
        return contextlib.nullcontext()
    return _in_layer(probe, tuple(int(c) for c in candidates), index)


@contextlib.contextmanager
def _in_layer(probe, candidates, index):
    outer, probe.layer = probe.layer, _Layer(candidates, index)
    try:
        yield
    finally:
        probe.layer = outer


@contextlib.contextmanager
def frame():
    """A dict of what the layers inside keep (empty without a probe), to be returned by the
    enclosing scan body or unrolled call and handed to ``collect``."""
    probe = _ACTIVE.get()
    values: dict = {}
    if probe is None:
        yield values
        return
    probe.frames.append(values)
    try:
        yield values
    finally:
        probe.frames.pop()


def collect(values: dict, period: int, repeat: int) -> None:
    """Hands an unrolled unit's frame to the probe (see ``Probe.collect``); a no-op without one."""
    probe = _ACTIVE.get()
    if probe is not None and values:
        probe.collect(values, period, repeat)


def scan(body, init, xs, period: int):
    """``jax.lax.scan(body, init, xs)`` for a stack's layers, whose body returns the frame
    it kept last among its outputs; returns ``(carry, outputs without the frame)``.

    With a probe capturing a name at only some of the repeats, the kept values go into a
    carried buffer of those repeats alone (its shapes from one abstract call of the body),
    so the scan holds only what is captured; otherwise they are the scan's stacked outputs.
    """
    probe = _ACTIVE.get()
    if probe is None or not probe.patterns:
        carry, (*out, kept) = jax.lax.scan(body, init, xs)
        return carry, tuple(out)
    R = jax.tree.leaves(xs)[0].shape[0]
    first = jax.tree.map(lambda a: a[0], xs)
    *_, shapes = jax.eval_shape(body, init, first)[1]
    repeats = {k: probe._repeats(k, period, R) for k in shapes}
    if all(len(r) == R for r in repeats.values()):
        carry, (*out, kept) = jax.lax.scan(body, init, xs)
        probe.collect(kept, period)
        return carry, tuple(out)
    slots = {}  # per key: each repeat's row in the buffer (-1: not captured there)
    for k, rows in repeats.items():
        table = np.full((R,), -1, np.int32)
        table[rows] = np.arange(len(rows), dtype=np.int32)
        slots[k] = jnp.asarray(table)
    buffers = {k: jnp.zeros((len(repeats[k]), *v.shape), v.dtype) for k, v in shapes.items()}

    def buffered(carry, xs_r):
        (inner, bufs), (r, x) = carry, xs_r
        inner, (*out, kept) = body(inner, x)
        for k, value in kept.items():
            slot = slots[k][r]
            row = jnp.maximum(slot, 0)
            old = jax.lax.dynamic_index_in_dim(bufs[k], row, 0, keepdims=False)
            new = jnp.where(slot >= 0, value, old)
            bufs[k] = jax.lax.dynamic_update_index_in_dim(bufs[k], new, row, 0)
        return (inner, bufs), tuple(out)

    steps = jnp.arange(R, dtype=jnp.int32)
    (carry, buffers), out = jax.lax.scan(buffered, (init, buffers), (steps, xs))
    probe.collect(buffers, period, repeats)
    return carry, out


def weights_call(call):
    """``call`` asking the attention for its weights when a probe captures them here."""
    if wants("weights") and not call.return_weights:
        return call.replace(return_weights=True)
    return call
