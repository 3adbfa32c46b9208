"""The optimiser: AdamW or Muon with global-norm clipping, a decay mask, warmup + decay.

``optim.name="muon"`` orthogonalises the momentum of every weight matrix (Newton-Schulz,
``optax.contrib.muon``) at ``learning_rate`` and trains the rest (embeddings, norms,
biases, position tables) with Adam at ``optim.adam_learning_rate``. Which axes of a weight
are the matrix's input and which its output is read from the parameter's shape suffix
(``q_DNH``: D in, N x H out; ``o_NHD``: N x H in, D out); a stack's layer axis is a batch
axis, so each layer's matrix is orthogonalised on its own.

No weight decay on norms, biases, embeddings and position tables unless
``optim.decay_embeddings``. The peak learning rate and weight decay sit in the optimiser state
(``optax.inject_hyperparams``), so trials that differ only in them can share one program; the
schedule multiplies the peak as a function of the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attnlab.contracts.optimizer import NO_DECAY_NAMES, SCHEDULES, get_optimizer, with_rule
from attnlab.devices import sharding
from attnlab.errors import ConfigError
from attnlab.nn import parametrization

# Schedules whose value at a step does not depend on the total step count before the decay:
# a finished run trained on to more steps continues exactly (WSD places its decay by the new
# total, so it continues from a checkpoint taken before the old decay began).
EXTENSIBLE_SCHEDULES = ("constant", "wsd")


def wsd_decay_start(o, total_steps: int) -> int:
    """The step where warmup-stable-decay starts its decay: the last ``decay_fraction``."""
    decay = round(float(o.get("decay_fraction", 0.1)) * total_steps)
    return max(total_steps - decay, int(o.warmup_steps))


def lr_multiplier(o, total_steps: int):
    """The schedule as a multiplier of the peak learning rate, a function of the step.

    ``wsd`` (warmup-stable-decay) holds the peak after warmup and decays linearly to
    ``min_lr_ratio`` over the last ``optim.decay_fraction`` of the steps.

    ``optim.extended`` (written by ``attnlab train --extend``) lists ``[step, steps before]``
    for each time the run was trained on to another ``train.steps``: from that step on the
    schedule of the steps before is stretched in time to end at the new total, so the rate
    carries on from where it was, with the same shape (``extended_multiplier``).
    """
    extended = [(int(a), int(b)) for a, b in (o.get("extended") or ())]
    if not extended:
        return _lr_multiplier(o, total_steps)
    return extended_multiplier(_lr_multiplier(o, extended[0][1]), extended, total_steps)


def extended_multiplier(base, extended, total_steps: int):
    """``base`` (the first schedule, over ``extended[0][1]`` steps) continued through each
    ``(start, steps before)`` of ``extended`` to ``total_steps``: steps after ``start`` map
    linearly onto ``[start, steps before]``, the span the earlier schedule had left."""
    totals = [b for _, b in extended] + [int(total_steps)]
    pairs = zip(extended, totals[:-1], totals[1:], strict=True)
    warps = [(a, old, new) for (a, _), old, new in pairs]

    def schedule(step):
        t = jnp.asarray(step, jnp.float32)
        for start, old, new in reversed(warps):  # the last extension first
            ratio = max(old - start, 0) / max(new - start, 1)
            t = jnp.where(t > start, start + (t - start) * ratio, t)
        return base(t)

    return schedule


def _lr_multiplier(o, total_steps: int):
    """The configured schedule over ``total_steps`` (``lr_multiplier`` without extensions)."""
    warmup = max(int(o.warmup_steps), 0)
    decay_steps = max(total_steps - warmup, 1)
    if o.schedule == "wsd":
        warmup_end = warmup
        warmup = wsd_decay_start(o, total_steps)  # the stable phase ends where the decay starts
        decay_steps = max(total_steps - warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (step + 1.0) / max(warmup, 1)) if warmup else 1.0
        if o.schedule == "wsd":
            warm = jnp.minimum(1.0, (step + 1.0) / max(warmup_end, 1)) if warmup_end else 1.0
        frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        decay = SCHEDULES[o.schedule](o, frac)
        return jnp.where(step < warmup, warm, decay)

    return schedule


def decay_mask(params, decay_embeddings: bool = False):
    """True for weights that take weight decay: matrices, but not norms/biases/embeddings.

    Parameters of a stack of layers carry a leading layer axis, which does not count: a
    stacked norm scale ``[L, D]`` is still a vector.
    """

    def decide(path, x):
        name = jax.tree_util.keystr(path)
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        if x.ndim - stacked < 2:
            return False
        return decay_embeddings or not any(n in name for n in NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(o, total_steps: int, params, model=None, multipliers=None):
    """The registered optimiser ``optim.name`` (hyperparameters injected into the state),
    after global-norm clipping, times the schedule; each parameter's update times its
    learning-rate multiplier when ``model`` (its ``ModelConfig``) is not in the standard
    parametrisation (``attnlab.nn.parametrization``). ``multipliers(rule)`` gives those of
    ``params`` when they are not the model's own (LoRA's adapters,
    ``attnlab.train.lora.multipliers``)."""
    opt = get_optimizer(o.get("name", "adamw"))
    mask = decay_mask(params, o.decay_embeddings)
    if model is None or parametrization.is_standard(model):
        core = opt.build(o, params, mask)
    else:
        check_rule(o, model)
        table = multipliers or (lambda rule: parametrization.lr_multipliers(model, rule))
        scale = parametrization.scale_updates(table(opt.rule))
        if opt.scale_inside:
            core = opt.build(o, params, mask, scale=scale)
        else:
            core = optax.chain(opt.build(o, params, mask), scale)
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    return optax.chain(*parts, core, optax.scale_by_schedule(lr_multiplier(o, total_steps)))


def check_rule(o, model) -> None:
    """A ``ConfigError`` when ``model.parametrization`` needs a learning-rate rule that the
    optimiser ``optim.name`` does not have."""
    name = o.get("name", "adamw")
    if not parametrization.is_standard(model) and get_optimizer(name).rule is None:
        raise ConfigError(
            f"optim.name={name!r} has no learning-rate rule for model.parametrization="
            f"{model.parametrization!r}: use one of {with_rule(model.parametrization)}, or "
            "model.parametrization='standard'"
        )


def layers_over_batch_devices(tree):
    """Asks for every stacked matrix of ``tree`` (gradients or updates) to be split by layer
    over the devices that split the batch (a sharding constraint; nothing without a mesh).
    Around Muon's update, each device then orthogonalises its share of the layers
    (Newton-Schulz iterations) instead of every device doing all of them."""

    def one(u):
        if u.ndim < 3:
            return u
        return sharding.constrain(u, "batch", *[None] * (u.ndim - 1))

    return jax.tree.map(one, tree)


def injected_hyperparams(opt_state) -> dict:
    """The hyperparameters held in the optimiser state (``learning_rate`` is the peak)."""
    return next(
        s for s in jax.tree.leaves(opt_state, is_leaf=_is_injected) if _is_injected(s)
    ).hyperparams


# The optimiser values held in its state: a resumed run with --allow-changes updates them,
# and a sweep's trials share one initialisation program and then set their own.
INJECTED = ("learning_rate", "weight_decay", "b1", "b2", "eps", "adam_learning_rate", "muon_beta")


def set_optim_values(opt_state, o):
    """Sets the optimiser values held in ``opt_state`` to those of the config ``o``."""
    hyper = injected_hyperparams(opt_state)
    where = get_optimizer(o.get("name", "adamw")).state_names
    for name in INJECTED:
        key = where.get(name, name)
        if key in hyper:
            old = jnp.asarray(hyper[key])
            # where the old value lies (replicated over a mesh); no compile for the cast
            hyper[key] = jax.device_put(np.asarray(float(o[name]), old.dtype), old.sharding)


def learning_rate(opt_state, o, total_steps, step):
    """The learning rate applied at ``step`` (peak from the state times the schedule)."""
    return injected_hyperparams(opt_state)["learning_rate"] * lr_multiplier(o, total_steps)(step)


def _is_injected(x):
    return isinstance(x, optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState)
