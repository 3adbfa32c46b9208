"""A fused attention kernel on a mesh: the call under ``jax.shard_map``, each device running the
kernel on its own rows and heads.

A Pallas kernel is one opaque call to the compiler's partitioner: Mosaic TPU refuses to be
partitioned automatically ("wrap the call in a shard_map"), and a Triton call would be run on
gathered, replicated inputs. So under a mesh (``jax.set_mesh``, as
``attnlab.devices.sharding.activate`` makes one current) the kernel runs inside
``shard_map``: the batch split over the ``data`` and ``fsdp`` axes and the heads over
``tensor``, each where its size divides (as ``sharding.constrain`` places activations; the
heads stay whole when the kv heads do not split with them). Every other mesh axis computes
the same call. The Mosaic TPU kernel reads a score function's array of two or more axes per
block by its own row and head, which a shard's offsets hide from it: on a mesh such a call
takes the chunked path, and says so (``reads_arrays_per_row``).

Inside, the kernel sees its shard: its rows of the mask fields, ``q_offset`` and a dense
mask, its heads' sinks. A score function keeps its meaning: it receives the global batch row
and query head (the shard's offsets added to the local ones), and the arrays it closes over
stay global (gathered where they are sharded), so ``slopes[h]`` or ``gate[b, h, q]`` read
what they read without a mesh.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from attnlab.ops.masks import MaskSpec
from attnlab.ops.shards import fit_axes, spec_axes

BATCH_AXES, HEAD_AXES = ("data", "fsdp"), ("tensor",)


def reads_arrays_per_row(score_mod) -> bool:
    """Whether ``score_mod`` closes over an array of two or more axes (FoX's ``[B, N, S]``
    gate), which the Mosaic TPU kernel reads per block by its own row and head (a per-head
    vector such as ALiBi's slopes is read as a scalar and splits as usual)."""
    if score_mod is None:
        return False
    example = (
        jax.ShapeDtypeStruct((8, 8), jnp.float32),
        *(jax.ShapeDtypeStruct((), jnp.int32),) * 2,
        jax.ShapeDtypeStruct((8, 1), jnp.int32),
        jax.ShapeDtypeStruct((1, 8), jnp.int32),
    )
    consts = jax.make_jaxpr(score_mod)(*example).consts
    return any(jnp.ndim(c) >= 2 for c in consts)


def current_mesh():
    """The current abstract mesh when it has an axis of more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(size == 1 for size in mesh.shape.values()):
        return None
    return mesh


def _rows(x, b):
    """The spec of an array whose leading axis is the batch (or broadcast over it)."""
    return P(b if x.shape[0] > 1 else None, *([None] * (x.ndim - 1)))


def _dense(mask, b, h):
    """The spec of a ``[B|1, N|1, T, S]`` mask."""
    return P(b if mask.shape[0] > 1 else None, h if mask.shape[1] > 1 else None, None, None)


def _mask_specs(mask, b, h):
    """Specs of a dense mask, or of a ``MaskSpec``'s array fields (a Python int window stays
    in the spec as it is: static)."""
    if not isinstance(mask, MaskSpec):
        return _dense(mask, b, h)
    specs = {}
    for field in dataclasses.fields(mask):
        x = getattr(mask, field.name)
        if field.metadata.get("static") or not hasattr(x, "shape"):
            continue
        if x.ndim == 0:
            specs[field.name] = P()
        elif field.name == "allowed":
            specs[field.name] = _dense(x, b, h)
        else:
            specs[field.name] = _rows(x, b)
    return specs


def partitioned(fn, q_BTNH, k_BSKH, v_BSKH, kwargs, mesh):
    """``fn(q, k, v, **kwargs)`` (a kernel) under ``shard_map`` on ``mesh``."""
    B, _, N, _ = q_BTNH.shape
    K = k_BSKH.shape[2]
    batch = fit_axes(mesh, BATCH_AXES, B)
    heads = fit_axes(mesh, HEAD_AXES, K, taken=batch)  # K divides N: both split alike
    b, h = spec_axes(batch), spec_axes(heads)
    n_rows = math.prod(mesh.shape[a] for a in batch)
    n_heads = math.prod(mesh.shape[a] for a in heads)
    args = {"q": q_BTNH, "k": k_BSKH, "v": v_BSKH}
    specs = {"q": P(b, None, h, None), "k": P(b, None, h, None), "v": P(b, None, h, None)}
    mask = kwargs.get("mask")
    if mask is not None:
        mask_specs = _mask_specs(mask, b, h)
        if isinstance(mask, MaskSpec):
            fields = {n: getattr(mask, n) for n in mask_specs}
            args["mask"], specs["mask"] = fields, mask_specs
        else:
            args["mask"], specs["mask"] = mask, mask_specs
    if kwargs.get("sinks") is not None:
        args["sinks"], specs["sinks"] = kwargs["sinks"], P(h)
    offset = kwargs.get("q_offset")
    if offset is not None and getattr(offset, "ndim", 0) == 1 and offset.shape[0] > 1:
        args["q_offset"], specs["q_offset"] = offset, P(b)
    score_mod = kwargs.get("score_mod")

    def local(a):
        call = {k: v for k, v in kwargs.items() if k not in ("mask", "sinks")}
        if mask is not None:
            m = a["mask"]
            call["mask"] = dataclasses.replace(mask, **m) if isinstance(mask, MaskSpec) else m
        if "sinks" in a:
            call["sinks"] = a["sinks"]
        if "q_offset" in a:
            call["q_offset"] = a["q_offset"]
        if score_mod is not None:  # the global row and head, as without a mesh
            b0 = lax.axis_index(batch) * (B // n_rows) if batch else 0
            h0 = lax.axis_index(heads) * (N // n_heads) if heads else 0
            call["score_mod"] = lambda s, bb, hh, qi, ki: score_mod(s, bb + b0, hh + h0, qi, ki)
        return fn(a["q"], a["k"], a["v"], **call)

    # check_vma off: a Pallas call's outputs carry no record of the axes they vary over.
    return jax.shard_map(
        local, mesh=mesh, in_specs=(specs,), out_specs=specs["q"], check_vma=False
    )(args)
