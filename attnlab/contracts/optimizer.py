"""The optimisers and learning-rate schedules a config may name: two registries.

``@register_optimizer(name, state_names=..., rule=...)`` adds a builder ``(o, params, mask)
-> optax.GradientTransformation`` (``o``: the ``optim`` config, ``mask``: which parameters
take weight decay); its hyperparameters should be injected (``optax.inject_hyperparams``) so
a resumed run and a sweep's trials can set them in the state (a value that is not injected
is baked into a stacked group's shared program). ``state_names`` maps an ``optim`` field to
the name the optimiser's state keeps it under, where they differ. ``rule`` names how the
per-parameter learning rates follow width under muP (``attnlab.nn.parametrization.RULES``:
"adam", "muon", "sgd"); None: the optimiser has no such rule and trains only the standard
parametrisation. The multipliers scale the builder's updates; a builder whose update is no
multiple of its learning rate (schedule-free) takes them as ``scale=`` (an optax
transformation) and applies them inside (``scale_inside=True``).
``@register_schedule(name)`` adds the decay of the peak learning rate after warmup, a
function of the fraction of the decay phase done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from attnlab.devices.sharding import stacked_path

# Parameters that are no matrices in the optimiser's sense: no weight decay, Adam in Muon.
NO_DECAY_NAMES = ("embedding", "table", "token_types", "bias")
# Shape letters of axes that make a weight no matrix for Muon (Adam updates it): a short
# causal convolution's taps W (a recurrent layer's ``conv_WZ`` is one depthwise filter per
# channel, not a linear map between two spaces). Weight decay still applies to it.
NOT_MATRIX_AXES = ("W",)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """A registered optimiser: its builder and where its state keeps the ``optim`` values."""

    name: str
    build: Callable
    state_names: dict
    rule: str | None = None
    scale_inside: bool = False


OPTIMIZERS: dict[str, Optimizer] = {}
SCHEDULES: dict[str, Callable] = {}


def register_optimizer(
    name: str, *, state_names: dict | None = None, rule: str | None = None,
    scale_inside: bool = False,
):  # fmt: skip
    """Registers ``build(o, params, mask)`` as ``optim.name=name``."""

    def add(build):
        OPTIMIZERS[name] = Optimizer(name, build, dict(state_names or {}), rule, scale_inside)
        return build

    return add


def register_schedule(name: str):
    """Registers ``decay(o, frac)`` (``frac``: 0 to 1 over the decay phase) as
    ``optim.schedule=name``."""

    def add(decay):
        SCHEDULES[name] = decay
        return decay

    return add


def get_optimizer(name: str) -> Optimizer:
    """The registered optimiser ``name`` (a ``ValueError`` listing them otherwise)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not registered; use one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name]


@register_optimizer("adamw", rule="adam")
def adamw(o, params, mask):
    """AdamW, decoupled weight decay on ``mask``."""
    return optax.inject_hyperparams(optax.adamw)(
        learning_rate=o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
        weight_decay=o.weight_decay, mask=mask,
    )  # fmt: skip


@register_optimizer(
    "muon", state_names={"b1": "adam_b1", "b2": "adam_b2", "muon_beta": "beta"}, rule="muon"
)
def muon(o, params, mask):
    """Muon on the matrices (``muon_dimensions``), Adam at ``adam_learning_rate`` on the rest.
    ``muon_ns_steps`` Newton-Schulz iterations, a static count (a loop the compiler sees
    whole, and a different program for each count)."""
    return optax.inject_hyperparams(optax.contrib.muon, static_args=("ns_steps",))(
        learning_rate=o.learning_rate,
        ns_steps=int(o.get("muon_ns_steps", 5)),
        beta=o.get("muon_beta", 0.95),
        weight_decay=o.weight_decay,
        weight_decay_mask=mask,
        adam_b1=o.b1,
        adam_b2=o.b2,
        eps=o.eps,
        adam_learning_rate=o.get("adam_learning_rate", 3e-3),
        muon_weight_dimension_numbers=muon_dimensions(params),
    )


@register_optimizer("lion", rule="adam")
def lion(o, params, mask):
    """Lion (Chen et al., 2023): the sign of an interpolated momentum, ``b1``/``b2`` its two
    betas, decoupled weight decay on ``mask``. Its updates are larger than Adam's: sweep
    ``learning_rate`` 3-10x lower."""
    return optax.inject_hyperparams(optax.lion)(
        learning_rate=o.learning_rate, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=mask
    )


@register_optimizer("adafactor", rule="adam")
def adafactor(o, params, mask):
    """Adafactor (Shazeer and Stern, 2018) with a factored second moment (``b2`` its decay),
    update clipping at 1, momentum ``b1`` and weight decay on ``mask``; without its relative
    step (updates are not multiplied by the parameter's scale), so it takes a learning rate
    as Adam does and follows Adam's muP rule."""

    def make(learning_rate, b1, b2, weight_decay):
        return optax.adafactor(
            learning_rate, multiply_by_parameter_scale=False, momentum=b1, decay_rate=b2,
            weight_decay_rate=weight_decay, weight_decay_mask=mask,
        )  # fmt: skip

    return optax.inject_hyperparams(make)(
        learning_rate=o.learning_rate, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay
    )


@register_optimizer("schedule_free_adamw", rule="adam", scale_inside=True)
def schedule_free_adamw(o, params, mask, scale=None):
    """Schedule-free AdamW (Defazio et al., 2024): Adam's second moment, interpolation ``b1``
    between the averaged and the latest iterate; pair it with ``optim.schedule="constant"``
    (warmup still applies). The parameters it trains and evaluates are the interpolated
    point (``optax.contrib.schedule_free_eval_params`` gives the average)."""

    def make(learning_rate, b1, b2, eps, weight_decay):
        base = optax.chain(
            optax.scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True),
            optax.add_decayed_weights(weight_decay, mask),
            *([scale] if scale is not None else []),
            optax.scale_by_learning_rate(learning_rate),
        )
        return optax.contrib.schedule_free(base, learning_rate=learning_rate, b1=b1)

    return optax.inject_hyperparams(make)(
        learning_rate=o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay
    )


@register_optimizer("adabelief", rule="adam")
def adabelief(o, params, mask):
    """AdaBelief (Zhuang et al., 2020): Adam with the gradient's variance around its mean as
    the second moment; decoupled weight decay on ``mask``."""

    def make(learning_rate, b1, b2, eps, weight_decay):
        return optax.chain(
            optax.scale_by_belief(b1=b1, b2=b2, eps=eps),
            optax.add_decayed_weights(weight_decay, mask),
            optax.scale_by_learning_rate(learning_rate),
        )

    return optax.inject_hyperparams(make)(
        learning_rate=o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay
    )


@register_optimizer("sgd", rule="sgd")
def sgd(o, params, mask):
    """SGD with heavy-ball momentum ``b1`` and decoupled weight decay on ``mask``."""

    def make(learning_rate, b1, weight_decay):
        return optax.chain(
            optax.add_decayed_weights(weight_decay, mask),
            optax.trace(decay=b1),
            optax.scale_by_learning_rate(learning_rate),
        )

    return optax.inject_hyperparams(make)(
        learning_rate=o.learning_rate, b1=o.b1, weight_decay=o.weight_decay
    )


@register_optimizer("lamb")
def lamb(o, params, mask):
    """LAMB (You et al., 2019): Adam whose update each layer rescales to its weights' norm
    (the trust ratio). No muP rule: the trust ratio already ties the step to the weights'
    scale, so it trains the standard parametrisation only."""
    return optax.inject_hyperparams(optax.lamb)(
        learning_rate=o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
        weight_decay=o.weight_decay, mask=mask,
    )  # fmt: skip


def with_rule(parametrization: str) -> list[str]:
    """The optimisers that can train ``parametrization`` (all of them for "standard")."""
    return sorted(n for n, o in OPTIMIZERS.items() if parametrization == "standard" or o.rule)


def muon_dimensions(params):
    """Muon's reading of each weight: ``MuonDimensionNumbers`` for the matrices of the
    attention, recurrent and feed-forward layers, None (Adam) for everything else: vectors,
    embeddings and biases (``NO_DECAY_NAMES``), and weights with an axis of
    ``NOT_MATRIX_AXES`` (convolution kernels)."""

    def decide(path, x):
        name = jax.tree_util.keystr(path)
        stacked = stacked_path(path)
        if x.ndim - stacked < 2 or any(n in name for n in NO_DECAY_NAMES):
            return None
        keys = [getattr(k, "key", getattr(k, "name", "")) for k in path]
        suffix = next(str(k) for k in reversed(keys) if str(k) not in ("value", "raw_value"))
        suffix = suffix.rsplit("_", 1)[-1]
        if any(letter in NOT_MATRIX_AXES for letter in suffix):
            return None
        axes = tuple(range(int(stacked), x.ndim))
        if suffix.startswith("D"):  # from the model width to the rest (q_DNH, w_in_DF)
            return optax.contrib.MuonDimensionNumbers(reduction_axis=axes[:1], output_axis=axes[1:])
        return optax.contrib.MuonDimensionNumbers(reduction_axis=axes[:-1], output_axis=axes[-1:])

    return jax.tree_util.tree_map_with_path(decide, params)


@register_schedule("cosine")
def cosine(o, frac):
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac))


@register_schedule("linear")
def linear(o, frac):
    return 1.0 - (1.0 - o.min_lr_ratio) * frac


@register_schedule("constant")
def constant(o, frac):
    return jnp.ones_like(frac)


# Warmup-stable-decay: the peak held after warmup, a linear decay over the last
# ``optim.decay_fraction`` of the steps (``train.optim.lr_multiplier`` places the phases).
register_schedule("wsd")(linear)
