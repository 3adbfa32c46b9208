"""Low-rank adapters (LoRA, Hu et al. 2021) on any weight of any model, by parameter path.

The config group ``lora``: ``rank`` (0: off), ``alpha`` (the update is ``alpha / rank``
times ``A B``), ``targets`` (globs over dotted parameter paths such as
``decoder.layers.attn.q_DNH``, or the short names ``q``, ``k``, ``v``, ``o`` (attention's
projections), ``ffn`` (every FFN matrix) and ``mixer`` (every matrix of a layer's mixer,
a new variant's own included)) and ``dropout`` (rank dropout: each step drops each of the
``r`` components with this probability, rescaling the rest).

The design: adapters are a pytree of their own beside the frozen parameters, ``{path:
{"a": A, "b": B}}``, and the effective weight ``W + (alpha / r) A B`` is computed in the
forward pass (``merge``) before the model is built from the parameters (``nnx.merge``).
So no module knows of LoRA: every weight of every registered mixer or FFN can be targeted
by its path, the model's own code and cache are untouched, the optimiser sees the adapters
alone (the base takes no gradient and has no optimiser state), and ``merge`` with the final
adapters is the exported model: one function both trains and merges, so merged and
unmerged outputs agree to the rounding of ``W + delta``.

A weight's matrix form is read from its shape suffix as Muon reads it: a leading layer axis
(a stack's) is a batch axis; ``q_DNH`` maps its first axis to the rest, ``o_NHD`` its
leading axes to the last. ``A`` is ``[L?, I, r]`` (Kaiming-uniform, as the reference
implementation), ``B`` ``[L?, r, O]`` (zeros), so training starts at the base model.

Any run trains adapters when its ``lora.rank`` is above 0 (``attnlab.train.Trainer``): the
train state then holds the frozen parameters under ``"params"`` and the adapters under
``"lora"`` (``trained``), the optimiser's state is the adapters', and the model's weights are
``weights(spec, params, adapters)``. Under muP (``model.parametrization``) each factor takes
the learning-rate multiplier of a matrix of its own shape (``lr_multipliers``): ``A`` (from
the weight's input to ``r``) that of a read-out, ``B`` (from ``r`` to the weight's output)
that of an input weight, so with Adam ``A``'s rate falls as ``base_fan_in / fan_in`` and
``B``'s stays (LoRA+'s ``lr_B / lr_A`` growing with the width, Hayou et al. 2024); at the
base width both are 1. ``alpha / r`` and ``A``'s initialisation do not change with width.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import pathlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.contracts.optimizer import NO_DECAY_NAMES
from attnlab.devices.sharding import stacked_path
from attnlab.experiment.lora_spec import (  # noqa: F401  (the config group, checked)
    ALIASES,
    LoraSpec,
    _fail,
    check,
    spec_from,
)

FILE = "lora_adapters.npz"


def path_name(path) -> str:
    """A parameter's dotted path (``decoder.layers.attn.q_DNH``) from a pytree path."""
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
    return ".".join(str(k) for k in keys if str(k) not in ("value", "raw_value"))


def matrix_form(path, x) -> tuple[int, int, int] | None:
    """``(lead, n_in, n_out)``: a weight's leading stack axes (0 or 1), and how many of its
    other axes are the matrix's input and its output; None for what is not a matrix
    (vectors, embeddings, norms, biases)."""
    name = path_name(path)
    lead = int(stacked_path(path))
    rest = x.ndim - lead
    if rest < 2 or any(n in name for n in NO_DECAY_NAMES):
        return None
    suffix = name.rsplit(".", 1)[-1].rsplit("_", 1)[-1]
    if suffix.startswith("D"):  # from the model width to the rest (q_DNH, w_in_DF)
        return lead, 1, rest - 1
    return lead, rest - 1, 1


def targets(spec: LoraSpec, params) -> dict:
    """``{path: (shape, (lead, n_in, n_out))}`` of the weights ``spec`` adapts; a
    ``ConfigError`` naming ``lora.targets`` when a pattern matches none, listing those
    there are."""
    out, matrices = {}, []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name, form = path_name(path), matrix_form(path, x)
        if form is not None:
            matrices.append(name)
            if any(fnmatch.fnmatchcase(name, p) for p in spec.patterns()):
                out[name] = (tuple(x.shape), form)
    idle = [t for t, p in zip(spec.targets, spec.patterns(), strict=True)
            if not any(fnmatch.fnmatchcase(n, p) for n in matrices)]  # fmt: skip
    if idle:
        _fail(
            "targets",
            spec.targets,
            f"{', '.join(map(repr, idle))} matches no weight matrix of the model; use names "
            f"among {sorted(ALIASES)} or path globs over its weight matrices: "
            f"{', '.join(matrices)}",
        )
    return out


def _dims(shape, form):
    lead, n_in, n_out = form
    return shape[:lead], math.prod(shape[lead : lead + n_in]), math.prod(shape[lead + n_in :])


def init(spec: LoraSpec, params, key) -> dict:
    """Fresh adapters for ``params`` (``A`` Kaiming-uniform, ``B`` zeros), float32."""
    out = {}
    for i, (name, (shape, form)) in enumerate(sorted(targets(spec, params).items())):
        lead, fan_in, fan_out = _dims(shape, form)
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) as peft's
        k = jax.random.fold_in(key, i)
        a = jax.random.uniform(k, (*lead, fan_in, spec.rank), jnp.float32, -bound, bound)
        out[name] = {"a": a, "b": jnp.zeros((*lead, spec.rank, fan_out), jnp.float32)}
    return out


def delta(spec: LoraSpec, adapter: dict, shape, keep_R=None):
    """``(alpha / r) A B`` in the weight's shape (``keep_R``: rank dropout's 0/1 mask)."""
    a, b = adapter["a"], adapter["b"]
    if keep_R is not None:  # A's columns, in every layer of a stack
        a = a * (keep_R / (1.0 - spec.dropout)).astype(a.dtype).reshape((1,) * (a.ndim - 1) + (-1,))
    return (spec.scale * jnp.matmul(a, b)).reshape(shape)


def merge(spec: LoraSpec, params, adapters: dict, key=None):
    """``params`` with ``W + (alpha / r) A B`` at every adapted weight (in ``W``'s dtype);
    ``key`` (training) draws rank dropout when ``spec.dropout > 0``."""

    def one(path, w):
        name = path_name(path)
        if name not in adapters:
            return w
        keep = None
        if key is not None and spec.dropout > 0:
            k = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
            keep = jax.random.bernoulli(k, 1.0 - spec.dropout, (spec.rank,))
        return (w + delta(spec, adapters[name], w.shape, keep).astype(w.dtype)).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def abstract(spec: LoraSpec, params) -> dict:
    """The adapters' shapes and dtypes for ``params`` (abstract or concrete); checks
    ``lora.targets``."""
    return jax.eval_shape(lambda: init(spec, params, jax.random.key(0)))


def trained(state: dict):
    """What a train state's optimiser trains: its adapters, or its parameters without LoRA."""
    return state["lora"] if "lora" in state else state["params"]


def weights(spec: LoraSpec | None, params, adapters, key=None):
    """The model's parameters: ``adapters`` themselves without LoRA (``spec`` None, the
    parameters are what trains), else ``merge(spec, params, adapters, key)``."""
    return adapters if spec is None else merge(spec, params, adapters, key)


def nested(adapters: dict) -> dict:
    """``adapters`` as a tree nested like the parameters (``{"decoder": {"layers": ...}}``,
    each weight's ``{"a", "b"}`` at its path), for what reads parameter paths."""
    out: dict = {}
    for name, ad in adapters.items():
        node = out
        for key in name.split("."):
            node = node.setdefault(key, {})
        node.update(ad)
    return out


def lr_multipliers(spec: LoraSpec, mcfg, rule: str, adapters: dict) -> dict:
    """Each factor's learning-rate multiplier under ``model.parametrization`` and the
    optimiser's rule (``attnlab.nn.parametrization.RULES``), as the module docstring says."""
    from attnlab.nn import parametrization as mup

    is_scale = lambda v: isinstance(v, mup.Scale)
    flat = jax.tree_util.tree_flatten_with_path(mup.scales(mcfg), is_leaf=is_scale)[0]
    table = {path_name(p): s for p, s in flat}
    r, rate = spec.rank, mup.RULES[rule]
    out = {}
    for name in adapters:
        s = table[name]
        a = mup.Scale("readout", s.fan_in, r, s.base_fan_in, r, False)
        b = mup.Scale("input", r, s.fan_out, r, s.base_fan_out, False)
        out[name] = {"a": rate(a), "b": rate(b)}
    return out


def multipliers(spec: LoraSpec | None, mcfg, adapters):
    """``make_optimizer``'s ``multipliers``: ``rule -> lr_multipliers`` with LoRA, else None
    (the parameters' own)."""
    if spec is None:
        return None
    return lambda rule: lr_multipliers(spec, mcfg, rule, adapters)


def count(adapters: dict) -> int:
    """The adapters' parameter count."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(adapters)))


def save(path, spec: LoraSpec, adapters: dict) -> pathlib.Path:
    """Writes the adapters alone (and their spec) to ``path`` (``.npz``); returns it."""
    path = pathlib.Path(path)
    arrays = {f"{n}/{ab}": _host(v) for n, ad in adapters.items() for ab, v in ad.items()}
    arrays["__spec__"] = np.frombuffer(json.dumps(dataclasses.asdict(spec)).encode(), np.uint8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:  # then renamed: a reader never sees half a file
        np.savez(f, **arrays)
    os.replace(tmp, path)
    return path


def _host(x):
    """A host copy of an adapter (replicated over processes: its own shard is the whole)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(x)


def load(path) -> tuple[LoraSpec, dict]:
    """``(spec, adapters)`` from a file ``save`` wrote."""
    with np.load(path) as z:
        spec = json.loads(bytes(z["__spec__"]).decode())
        adapters: dict = {}
        for k in z.files:
            if k != "__spec__":
                n, ab = k.rsplit("/", 1)
                adapters.setdefault(n, {})[ab] = jnp.asarray(z[k])
    spec["targets"] = tuple(spec["targets"])
    return LoraSpec(**spec), adapters
