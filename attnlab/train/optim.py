"""The optimiser: AdamW with global-norm clipping, a decay mask, and warmup + decay.

No weight decay on norms, biases, embeddings and position tables unless
``optim.decay_embeddings``. The peak learning rate and weight decay sit in the optimiser state
(``optax.inject_hyperparams``), so trials that differ only in them can share one program; the
schedule multiplies the peak as a function of the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

NO_DECAY_NAMES = ("embedding", "table", "token_types", "bias")


def lr_multiplier(o, total_steps: int):
    """The schedule as a multiplier of the peak learning rate, a function of the step."""
    warmup = max(int(o.warmup_steps), 0)
    decay_steps = max(total_steps - warmup, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum(1.0, (step + 1.0) / max(warmup, 1)) if warmup else 1.0
        frac = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        if o.schedule == "cosine":
            decay = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        elif o.schedule == "linear":
            decay = 1.0 - (1.0 - o.min_lr_ratio) * frac
        else:
            decay = jnp.ones_like(frac)
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


def make_optimizer(o, total_steps: int, params):
    """AdamW (hyperparameters injected into the state), clipping and the schedule."""
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=o.learning_rate,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        mask=decay_mask(params, o.decay_embeddings),
    )
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    return optax.chain(*parts, adamw, optax.scale_by_schedule(lr_multiplier(o, total_steps)))


def injected_hyperparams(opt_state) -> dict:
    """The hyperparameters held in the optimiser state (``learning_rate`` is the peak)."""
    return next(
        s for s in jax.tree.leaves(opt_state, is_leaf=_is_injected) if _is_injected(s)
    ).hyperparams


def learning_rate(opt_state, o, total_steps, step):
    """The learning rate applied at ``step`` (peak from the state times the schedule)."""
    return injected_hyperparams(opt_state)["learning_rate"] * lr_multiplier(o, total_steps)(step)


def _is_injected(x):
    return isinstance(x, optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState)
