"""The train state: a dict ``{"params", "opt_state", "step", "acc", "key"}``, pure pytrees.

With LoRA (``lora.rank`` above 0, ``attnlab.train.lora``) it also holds the adapters under
``"lora"``: ``"params"`` stay frozen and ``"opt_state"`` is the adapters' alone. On a mesh
the adapters and their optimiser state are replicated (``state_shardings``): they are small,
and their names carry no axes.

``acc`` accumulates the loss and gradient norm between log lines *inside* the state, so a
run resumed from a checkpoint logs exactly what the uninterrupted run logs; its
``"metrics"`` holds each registered metric's accumulator (``attnlab.metrics``), by
name, so a checkpoint written with another set of metrics still restores
(``reconcile_acc``); ``key`` holds the seed's key data, from which each step's dropout key
is ``fold_in(key, step)``, so stacked trials can each carry their own. ``Trainer``
(``attnlab.train.steps``) builds and steps it.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from attnlab.devices import sharding
from attnlab.nn.models import init_params
from attnlab.ops.precision import wide
from attnlab.train import lora as lora_lib
from attnlab.train.optim import INJECTED

LORA_STREAM = 0x4C6F5241  # the adapters' initialisation key: fold_in(seed's key, this)


def init_compiler_options() -> dict:
    """XLA options for the train state's initialisation, a program that runs once: on CPU
    without the backend's optimisations, which took longer to compile (2.4 s of a small
    model's start-up on 2 cores) than they saved in running it (0.01 s against 0.09 s)."""
    return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


def init_program(mcfg, tx, metrics=(), lora=None):
    """The train state as a function of the seed: a closure over the model config, the
    optimiser, the metrics and the ``LoraSpec`` (None: no adapters) alone, so the cache of
    shared programs keeps no trainer alive."""

    def init(seed):
        return state_around(mcfg, tx, init_params(mcfg, seed), seed, metrics, lora)

    return init


def state_around(mcfg, tx, params, seed, metrics=(), lora=None):
    """The train state at step 0 around ``params``; with ``lora`` fresh adapters on them."""
    key = jax.random.key(seed)
    state = {
        "params": params,
        "step": jnp.zeros((), jnp.int32),
        "acc": zeros_acc(mcfg, metrics),
        "key": jax.random.key_data(key),
    }
    if lora is not None:
        state["lora"] = lora_lib.init(lora, params, jax.random.fold_in(key, LORA_STREAM))
    state["opt_state"] = tx.init(lora_lib.trained(state))
    return state


def state_shardings(abstract, mesh, rules):
    """Where each leaf of a train state lies on ``mesh`` (``sharding.tree_shardings``); a
    LoRA state's adapters and optimiser state replicated."""
    if "lora" not in abstract:
        return sharding.tree_shardings(abstract, mesh, rules)
    own = ("lora", "opt_state")
    rest = {k: v for k, v in abstract.items() if k not in own}
    out = sharding.tree_shardings(rest, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    return {**out, **{k: jax.tree.map(lambda _: replicated, abstract[k]) for k in own}}


def optim_structure(o) -> str:
    """An optim config group without the values that live in the optimiser state."""
    values = {k: v for k, v in o.to_dict().items() if k not in INJECTED}
    return json.dumps(values, sort_keys=True, default=str)


def zeros_acc(mcfg=None, metrics=()):
    """The empty accumulator of the train state (cleared after each log line), with one
    entry per metric of ``metrics`` (``attnlab.metrics``) under ``"metrics"``; float32, or
    float64 for a float64 ``mcfg`` (as ``Metric.dtype``)."""
    f = jnp.float32 if mcfg is None else wide(mcfg.dtype, mcfg.param_dtype)
    return {
        "loss_sum": jnp.zeros((), f),
        "tokens": jnp.zeros((), f),
        "grad_norm_sum": jnp.zeros((), f),
        "steps": jnp.zeros((), jnp.int32),
        "nonfinite": jnp.zeros((), jnp.int32),
        "first_nonfinite": jnp.zeros((), jnp.int32),
        "metrics": {m.name: m.zeros() for m in metrics},
    }


def accumulate(acc, ok, step, loss_sum, tokens, grad_norm, values, metrics):
    """``acc`` with one step's loss, tokens, gradient norm and metric ``values`` added when
    ``ok`` (the step was finite), and the step counted among the non-finite ones when not
    (``first_nonfinite``: the first such step, 1-based)."""
    zero = jnp.zeros((), acc["loss_sum"].dtype)
    return {
        "loss_sum": acc["loss_sum"] + jnp.where(ok, loss_sum, zero),
        "tokens": acc["tokens"] + jnp.where(ok, tokens, zero),
        "grad_norm_sum": acc["grad_norm_sum"] + jnp.where(ok, grad_norm, zero),
        "steps": acc["steps"] + ok.astype(jnp.int32),
        "nonfinite": acc["nonfinite"] + (~ok).astype(jnp.int32),
        "first_nonfinite": jnp.where(
            (acc["first_nonfinite"] == 0) & ~ok, step + 1, acc["first_nonfinite"]
        ),
        "metrics": {
            m.name: jax.tree.map(
                lambda a, c: jnp.where(ok, c, a),
                acc["metrics"][m.name],
                m.combine(acc["metrics"][m.name], values[m.name]),
            )
            for m in metrics
        },
    }


def reconcile_acc(restored: dict, empty: dict) -> dict:
    """``empty`` (this run's accumulator) with the values of ``restored`` (a checkpoint's)
    wherever a leaf has the same path, shape and dtype: a metric added since the checkpoint
    starts from its empty accumulator, one removed is dropped."""
    have = {
        jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]
    }

    def pick(path, z):
        x = have.get(jax.tree_util.keystr(path))
        if x is not None and x.shape == z.shape and x.dtype == z.dtype:
            return x
        return z

    return jax.tree_util.tree_map_with_path(pick, empty)


def all_finite(tree) -> jax.Array:
    """True when every floating leaf of ``tree`` is finite (one fused reduction)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))
