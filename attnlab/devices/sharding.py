"""The device mesh from the config, logical-axis rules, and shardings for state and batches.

Mesh axes are ``data``, ``fsdp``, ``tensor``, ``context`` and ``expert`` (a mixture of
experts' experts split over it; ``attnlab.nn.moe``) (``MESH_AXES``), all of the
``Auto`` axis type: shardings are placed on parameters, batches and a few activations, and
XLA (GSPMD) inserts the collectives. ``mesh_from_config`` builds the mesh from the
experiment's ``mesh`` group: one axis may be -1 to take the remaining devices; the default
puts every device on ``data``.

Every parameter names its logical axes through the shape suffix of its name, with the
letters of ``attnlab.dims`` (``q_DNH`` is ``embed, heads, head_dim``); the parameters of a
stack of layers (under ``layers`` or a stack's ``prefix``) add a leading ``layers`` axis.
One table of rules (``RULES``, data that an experiment overrides through ``mesh.rules``)
maps each logical axis to mesh axes. A mesh axis serves at most one axis of an array (the
first that asks); a dimension that an axis does not divide stays whole, except the ones in
``STRICT`` (heads, mlp, batch), which are an error naming both numbers. Optimiser state
follows its parameters (its leaves end in the same names); scalars and other state are
replicated.

``activate(mesh, rules)`` makes the mesh current (``jax.set_mesh``) and ``constrain(x,
*names)`` places a sharding constraint on an activation; without a current mesh it does
nothing, so the same model code runs on one device and on many.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from attnlab.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "context", "expert")


class MeshError(ConfigError):
    """A mesh that does not fit the devices, or a dimension that a mesh axis cannot split."""


LETTERS = {
    "L": "layers",
    "D": "embed",
    "N": "heads",
    "K": "kv_heads",
    "H": "head_dim",
    "F": "mlp",
    "V": "vocab",
    "P": "positions",
    "X": "buckets",
    "Y": "token_types",
    "R": "latent",
    "E": "expert",
    "J": "state_dim",
    "W": "conv_taps",
    "Z": "channels",
}
RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "layers": None,
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "positions": None,
    "buckets": None,
    "token_types": None,
    "latent": None,
    "expert": "expert",
    "state_dim": None,
    "conv_taps": None,
    "channels": None,
    # activations
    "batch": ("data", "fsdp"),
    "length": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}
STRICT = ("heads", "mlp", "batch")
# The path keys under which a stack holds parameters stacked on a leading layers axis (its
# ``layers`` and its ``prefix``, ``attnlab.nn.stack``).
STACKED = ("layers", "prefix")


def stacked_path(path) -> bool:
    """Whether a parameter's path lies in a stack's stacked layers (``STACKED``)."""
    return any(getattr(k, "key", getattr(k, "name", None)) in STACKED for k in path)


_RULES = contextvars.ContextVar("attnlab_sharding_rules", default=None)


def resolve_rules(overrides: Mapping | None = None) -> dict:
    """``RULES`` with an experiment's overrides; unknown logical names or mesh axes fail."""
    rules = dict(RULES)
    for name, axes in (overrides or {}).items():
        if name not in RULES:
            raise MeshError(
                f"mesh.rules names the logical axis {name!r}, which no parameter or activation "
                f"has; known: {sorted(RULES)}"
            )
        axes = tuple(axes) if isinstance(axes, list | tuple) else axes
        for axis in axes if isinstance(axes, tuple) else (axes,):
            if axis is not None and axis not in MESH_AXES:
                raise MeshError(
                    f"mesh.rules maps {name!r} to {axis!r}, which is no mesh axis; use one of "
                    f"{list(MESH_AXES)} or None"
                )
        rules[name] = axes
    return rules


def mesh_shape(sizes: Mapping[str, int], n_devices: int) -> tuple[int, ...]:
    """Axis sizes in ``MESH_AXES`` order, with one -1 resolved to the remaining devices."""
    shape = [int(sizes.get(axis, 1)) for axis in MESH_AXES]
    free = [a for a, s in zip(MESH_AXES, shape, strict=True) if s == -1]
    if len(free) > 1 or any(s == 0 or s < -1 for s in shape):
        raise MeshError(
            f"mesh axes {dict(zip(MESH_AXES, shape, strict=True))}: each must be a positive "
            "size, and at most one may be -1 (the remaining devices)"
        )
    fixed = math.prod(s for s in shape if s != -1)
    if free:
        if n_devices % fixed:
            raise MeshError(
                f"mesh.{free[0]}=-1 takes the devices left after the other axes ({fixed}), but "
                f"{n_devices} devices are not a multiple of {fixed}: change the fixed axes"
            )
        shape[MESH_AXES.index(free[0])] = n_devices // fixed
    if math.prod(shape) != n_devices:
        raise MeshError(
            f"the mesh {dict(zip(MESH_AXES, shape, strict=True))} has {math.prod(shape)} "
            f"devices but {n_devices} are present: make the product of mesh.data, mesh.fsdp, "
            "mesh.tensor and mesh.context equal the device count (one axis may be -1)"
        )
    return tuple(shape)


def make_mesh(sizes: Mapping[str, int] | None = None, devices=None) -> jax.sharding.Mesh:
    """The mesh of ``sizes`` (default: every device on ``data``) over ``devices``."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(sizes or {"data": -1}, len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def mesh_from_config(cfg) -> jax.sharding.Mesh:
    """The mesh of an experiment's ``mesh`` group."""
    return make_mesh({axis: int(cfg.mesh.get(axis, 1)) for axis in MESH_AXES})


def mesh_for_loading(cfg) -> jax.sharding.Mesh:
    """The mesh of the config where it fits this process's devices and splits
    ``train.batch_size``; otherwise a ``data`` mesh over as many devices as divide the batch
    (a run saved on 8 devices opens on 1, 3 or 16). The mesh changes where values live, not
    what they are, so a checkpoint restores onto any of them."""
    rules = resolve_rules(cfg.mesh.get("rules"))
    batch = int(cfg.train.batch_size)
    try:
        mesh = mesh_from_config(cfg)
        if batch % axis_size(mesh, rules.get("batch")) == 0:
            return mesh
    except MeshError:
        pass
    devices = jax.devices()
    n = max(k for k in range(1, len(devices) + 1) if batch % k == 0)
    return make_mesh({"data": n}, devices[:n])


def layout(mesh) -> str:
    """Where a run trains, in words: ``8 devices in 4 processes, mesh data=4 x tensor=2``."""
    n = 1 if mesh is None else mesh.size
    procs = 1 if mesh is None else len({d.process_index for d in mesh.devices.flat})
    axes = {} if mesh is None else {a: s for a, s in mesh.shape.items() if s > 1}
    shape = " x ".join(f"{a}={s}" for a, s in axes.items()) or "none"
    return f"{n} device{'s' * (n != 1)} in {procs} process{'es' * (procs != 1)}, mesh {shape}"


def axis_size(mesh, axes) -> int:
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def check_batch(mesh, rules, batch_size: int, field: str) -> None:
    """A batch of ``batch_size`` rows (the config's ``field``) must split evenly over the
    mesh's batch axes; a ``MeshError`` naming the field and the multiple otherwise."""
    n = axis_size(mesh, rules.get("batch"))
    if batch_size % n:
        raise MeshError(
            f"{field}={batch_size} is not divisible by the mesh's batch axes "
            f"({n} devices: mesh.data x mesh.fsdp); use a multiple of {n}"
        )


def spec(names, shape, mesh, rules, *, what: str) -> P:
    """The PartitionSpec of an array whose axes have the logical ``names``."""
    used, out = set(), []
    for name, size in zip(names, shape, strict=True):
        axes = rules.get(name)
        flat = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        flat = tuple(a for a in flat if a not in used and mesh.shape[a] > 1)
        n = axis_size(mesh, flat)
        if n > 1 and size % n:
            if name in STRICT:
                raise MeshError(
                    f"{what}: its {name} dimension ({size}) is not divisible by the mesh axes "
                    f"{list(flat)} ({n} devices): choose mesh sizes that divide {size}"
                )
            flat = ()
        used.update(flat)
        out.append(None if not flat else flat[0] if len(flat) == 1 else flat)
    return P(*out)


_SUFFIX = re.compile(r"_([A-Z]+)$")


def logical_names(path, shape) -> tuple[str, ...] | None:
    """The logical axes of a state leaf from its name's shape suffix (None: replicated, for
    scalars and unnamed vectors such as RNG key data; an unnamed matrix is an error)."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [k for k in keys if isinstance(k, str)]
    leaf = next((k for k in reversed(names) if _SUFFIX.search(k)), None)
    if len(shape) == 0 or (leaf is None and len(shape) == 1):
        return None
    if leaf is None:
        raise MeshError(
            f"state leaf {'/'.join(map(str, keys))} {tuple(shape)} has no shape suffix naming "
            "its axes (e.g. w_DF): parameters must be named with the letters of attnlab.dims"
        )
    letters = _SUFFIX.search(leaf).group(1)
    unknown = [c for c in letters if c not in LETTERS]
    if unknown:
        raise MeshError(f"parameter {leaf}: unknown axis letter(s) {unknown}")
    names_ = tuple(LETTERS[c] for c in letters)
    if stacked_path(path) and len(shape) == len(names_) + 1:
        names_ = ("layers",) + names_
    if len(names_) != len(shape):
        # Optimiser leaves that are not parameter-shaped (e.g. factored moments).
        return (None,) * len(shape)
    return names_


def tree_shardings(tree, mesh, rules):
    """NamedShardings for every leaf of a state pytree (arrays or ShapeDtypeStructs)."""

    def one(path, leaf):
        shape = np.shape(leaf)
        names = logical_names(path, shape)
        if names is None:
            return NamedSharding(mesh, P())
        where = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        return NamedSharding(mesh, spec(names, shape, mesh, rules, what=f"parameter {where}"))

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh, rules, ndim: int = 2) -> NamedSharding:
    axes = rules.get("batch")
    return NamedSharding(mesh, P(axes, *([None] * (ndim - 1))))


def place_batch(batch, mesh, rules, *, axis: int = 0):
    """Host arrays (this process's rows) as global arrays sharded over the batch axes;
    ``axis`` is the batch axis (1 for stacked trials). The axis after it, the sequence of
    ``[B, T]`` arrays, is split by the ``length`` rule (over ``context``) where that divides
    it; every process holds whole sequences, so only the rows are per process."""

    def one(x):
        x = np.asarray(x)
        spec = [None] * x.ndim
        spec[axis] = rules.get("batch")
        global_shape = None
        if x.ndim > axis + 1:
            length = [a for a in _flat(rules.get("length")) if mesh.shape[a] > 1]
            if length and x.shape[axis + 1] % axis_size(mesh, tuple(length)) == 0:
                spec[axis + 1] = length[0] if len(length) == 1 else tuple(length)
                # The sequence is whole on every process: say so (the default would take it
                # for this process's part of a longer one); the rows are as inferred.
                global_shape = list(x.shape)
                global_shape[axis] *= _process_share(mesh, rules.get("batch"))
                global_shape = tuple(global_shape)
        sharding_ = NamedSharding(mesh, P(*spec))
        return jax.make_array_from_process_local_data(sharding_, x, global_shape)

    return jax.tree.map(one, batch)


def _flat(axes) -> tuple[str, ...]:
    return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def _process_share(mesh, axes) -> int:
    """How many processes' rows make the global batch: the shards of ``axes`` over the
    shards this process's devices hold (what ``make_array_from_process_local_data``
    infers for an axis split evenly)."""
    axes = [a for a in _flat(axes) if mesh.shape[a] > 1]
    where = [mesh.axis_names.index(a) for a in axes]
    mine = {
        tuple(index[i] for i in where)
        for index in np.ndindex(mesh.devices.shape)
        if mesh.devices[index].process_index == jax.process_index()
    }
    return axis_size(mesh, tuple(axes)) // len(mine) if axes else 1


def initialize_distributed(d) -> bool:
    """``jax.distributed.initialize`` from a ``distributed`` config group, before any other
    use of JAX; True when it ran. "auto" runs with a coordinator address, or auto-detects
    in a SLURM job of several tasks; "on" always auto-detects what is not given."""
    import os

    mode = str(d.initialize)
    if mode not in ("auto", "on", "off"):
        raise MeshError(f"distributed.initialize={mode!r}: use 'auto', 'on' or 'off'")
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
    if mode == "off" or (mode == "auto" and not d.coordinator_address and not slurm):
        return False
    kwargs = {}
    if d.coordinator_address:
        kwargs["coordinator_address"] = str(d.coordinator_address)
    if int(d.num_processes) > 0:
        kwargs["num_processes"] = int(d.num_processes)
    if int(d.process_id) >= 0:
        kwargs["process_id"] = int(d.process_id)
    from attnlab.devices import processes  # stops with one line when a process is lost

    processes.initialize(
        kwargs,
        initialization_timeout=int(d.get("initialization_timeout_s", 300)),
        heartbeat_timeout=int(d.get("heartbeat_timeout_s", 100)),
    )
    return True


@contextlib.contextmanager
def activate(mesh, rules):
    """Makes ``mesh`` current (``jax.set_mesh``) and ``rules`` the ones ``constrain`` uses."""
    token = _RULES.set(rules)
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _RULES.reset(token)


def current_rules():
    """The rules ``activate`` made current, or None outside it."""
    return _RULES.get()


def constrain(x, *names):
    """``x`` constrained to the sharding of its logical axes under the current mesh."""
    rules = _RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return x
    specs = []
    used = set()
    for name, size in zip(names, x.shape, strict=True):
        axes = rules.get(name) if name else None
        flat = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        flat = tuple(a for a in flat if a not in used and mesh.shape[a] > 1)
        if flat and size % math.prod(mesh.shape[a] for a in flat):
            flat = ()
        used.update(flat)
        specs.append(None if not flat else flat[0] if len(flat) == 1 else flat)
    return jax.lax.with_sharding_constraint(x, P(*specs))


def shard_bytes(leaf, named_sharding) -> int:
    """Bytes of one device's shard of ``leaf`` (array or ShapeDtypeStruct), from shapes."""
    shape = named_sharding.shard_shape(np.shape(leaf))
    return int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize


def describe(abstract_state, shardings, mesh, top: int = 3) -> list[str]:
    """Lines for a run's start: the mesh, per-device parameter and optimiser bytes, and the
    sharding of the largest parameters."""

    def mib(b):
        unit = next((u for u, n in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if b >= 2**n), "B")
        return f"{b / 2 ** dict(GiB=30, MiB=20, KiB=10, B=0)[unit]:,.1f} {unit}"

    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES)
    lines = [f"mesh: {sizes} ({mesh.size} devices)"]
    per_device = {}
    for group in ("params", "opt_state"):
        leaves = jax.tree.leaves(abstract_state[group])
        shards = jax.tree.leaves(shardings[group])
        whole = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
        mine = sum(shard_bytes(x, s) for x, s in zip(leaves, shards, strict=True))
        per_device[group] = f"{mib(mine)} of {mib(whole)}"
    lines.append(
        f"per device: parameters {per_device['params']}, optimiser {per_device['opt_state']}"
    )
    flat = jax.tree_util.tree_flatten_with_path(abstract_state["params"])[0]
    specs = jax.tree.leaves(shardings["params"])
    ranked = sorted(zip(flat, specs, strict=True), key=lambda t: -int(np.prod(t[0][1].shape)))
    for (path, leaf), s in ranked[:top]:
        name = ".".join(str(getattr(k, "key", "")) for k in path if hasattr(k, "key"))
        lines.append(f"  {name} {tuple(leaf.shape)} -> {s.spec}")
    return lines


def per_device_bytes(tree) -> int:
    """Bytes that one device holds of a pytree of global arrays (its shards)."""
    device = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total
