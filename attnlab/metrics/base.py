"""The contract of what a train step computes besides the loss: a ``Metric``.

A metric (or an auxiliary loss, which is a metric that joins the objective) is one class in
one file, registered by name (``register_metric``)::

    @register_metric("attn_max_logit")
    class MaxLogit(Metric):
        needs = ("attention",)          # per-layer statistics asked of the model
        reduce = "max"                  # how micro-batches, devices and steps combine

        def shape(self, mcfg): ...      # the value's shape (a pytree of shapes)
        def value(self, view): ...      # from the step's intermediates (a StepView)

Phases. ``phase="forward"`` metrics read the forward pass (``StepView.out``: logits, the
last hidden state, the FFN's ``aux``, the ``stats`` the model collected for ``needs``) once
per micro-batch, inside the differentiated function; a metric with a loss weight joins the
objective there. ``phase="update"`` metrics read the step's gradients and updates
(``StepView.grads``, ``updates``, ``params``) once per step.

Reduction. ``reduce="mean"``: ``value`` returns ``(sums, counts)``; micro-batches and steps
add both, and the value is ``sums / counts`` (a micro-batch's own quotient is what joins the
loss, per counted token, as the cross-entropy does). ``"sum"``: values add. ``"max"``: the
largest. Devices need nothing more: the step is one program over the global batch (jit
with shardings), so a ``jnp.sum`` or ``jnp.max`` in ``value`` already spans every device.
Between two log lines the train state's ``acc["metrics"][name]`` holds the steps' values
combined the same way (means: summed, divided by the steps in ``record``).

Loss. ``loss_weight`` (None: observed only) is the default weight of a metric that may join
the objective; the config's ``train.loss_weights.<name>`` overrides it, and a weight of 0
leaves the metric observed only. The term added per counted token is ``weight *
as_loss(value)`` (``as_loss``: the sum of the value's leaves unless the metric says
otherwise).

Precision. A metric computes and accumulates in ``Metric.dtype``: float32, float64 for a
float64 model (``attnlab.ops.precision.wide`` of the model's dtypes).

Selection. ``train.metrics`` names the metrics to compute; those whose ``implied(mcfg)`` is
true (a mixture of experts' router losses, multi-token prediction) are always on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.ops.precision import wide

REDUCTIONS = ("mean", "sum", "max")
PHASES = ("forward", "update")


@dataclasses.dataclass(frozen=True)
class StepView:
    """What a metric reads. Forward phase: ``model``, ``batch``, ``kind``, ``out`` (the
    ``ModelOutput``, with ``stats``), ``targets``, ``mask`` (the loss mask, ``wide``) and
    ``tokens`` (counted tokens of the micro-batch), ``key``. Update phase: ``params`` (before
    the update), ``grads`` (normalised per token, clipped or not as the optimiser sees
    them), ``updates`` (what the optimiser adds to the parameters)."""

    mcfg: Any
    model: Any = None
    batch: Any = None
    kind: str = "lm"
    out: Any = None
    targets: Any = None
    mask: Any = None
    tokens: Any = None
    key: Any = None
    params: Any = None
    grads: Any = None
    updates: Any = None


class Metric:
    """Base of a registered metric (see the module docstring)."""

    name: ClassVar[str] = ""
    phase: ClassVar[str] = "forward"
    reduce: ClassVar[str] = "mean"
    needs: ClassVar[tuple] = ()  # names of per-layer statistics (attnlab.nn.segments)
    loss_weight: ClassVar[float | None] = None  # may join the objective with this weight

    def __init__(self, mcfg, weight: float | None = None, abstract_params=None):
        self.mcfg = mcfg
        self.weight = weight  # the weight it joins the objective with (None/0: observed)
        self.abstract_params = abstract_params

    @classmethod
    def implied(cls, mcfg) -> bool:
        """Whether the model needs this metric whatever ``train.metrics`` says."""
        return False

    @classmethod
    def check(cls, mcfg) -> None:
        """Raises ``ConfigError`` when the metric cannot apply to ``mcfg``."""

    @classmethod
    def default_weight(cls, mcfg) -> float | None:
        """The weight without ``train.loss_weights.<name>`` (None: observed only)."""
        return cls.loss_weight

    @property
    def dtype(self) -> jnp.dtype:
        """What the metric computes and accumulates in: float32, float64 for a model that
        computes or keeps its parameters in float64."""
        return wide(self.mcfg.dtype, self.mcfg.param_dtype)

    @property
    def joins_loss(self) -> bool:
        """Whether this metric adds to the objective (a weight other than None or 0)."""
        return bool(self.weight)

    def shape(self, mcfg):
        """The value's shape: a tuple, or a pytree (dict) of tuples."""
        return ()

    def value(self, view: StepView):
        """This step's (or micro-batch's) value from ``view``: ``(sums, counts)`` for a
        mean, the value itself for a sum or a max; arrays of ``shape``."""
        raise NotImplementedError

    def as_loss(self, value):
        """The scalar that joins the objective (times the weight)."""
        return sum(jnp.sum(x) for x in jax.tree.leaves(value))

    def record(self, value) -> dict:
        """Log-line entries from the window's value (host NumPy): a scalar as a float, an
        array as a list of floats, a dict as ``name/key`` entries."""
        return flat_record(self.name, value)

    # The reduction, shared by every metric.

    def zeros(self):
        """The empty accumulator of one step value (``reduce``'s identity)."""
        fill = -jnp.inf if self.reduce == "max" else 0.0
        return jax.tree.map(
            lambda s: jnp.full(s, fill, self.dtype), self.shape(self.mcfg), is_leaf=_is_shape
        )

    def reading_zeros(self):
        """The empty accumulator of micro-batch readings (``value``'s form)."""
        z = self.zeros()
        if self.reduce == "mean":
            return (z, jax.tree.map(jnp.zeros_like, z))
        return z

    def normalise(self, reading):
        """``value``'s output as arrays of ``dtype``; a mean's counts shaped like its sums
        (a scalar count applies to every leaf)."""
        cast = lambda x: jnp.asarray(x, self.dtype)
        if self.reduce != "mean":
            return jax.tree.map(cast, reading)
        sums, counts = reading
        sums = jax.tree.map(cast, sums)
        if jax.tree.structure(counts) != jax.tree.structure(sums):
            counts = jax.tree.map(lambda s: jnp.broadcast_to(cast(counts), s.shape), sums)
        return sums, jax.tree.map(cast, counts)

    def combine(self, a, b):
        """Two readings (or two step values) combined by ``reduce``."""
        op = jnp.maximum if self.reduce == "max" else jnp.add
        return jax.tree.map(op, a, b)

    def finish(self, reading):
        """A reading's value: ``sums / counts`` for a mean, else the reading."""
        if self.reduce == "mean":
            sums, counts = reading
            return jax.tree.map(lambda s, c: s / c, sums, counts)
        return reading

    def window(self, acc, steps: int):
        """The value over a log window from the accumulated steps (host)."""
        if self.reduce == "mean":
            return jax.tree.map(lambda a: np.asarray(a, np.float64) / max(steps, 1), acc)
        return jax.tree.map(lambda a: np.asarray(a, np.float64), acc)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def _number(x) -> float:
    return float(x)


def flat_record(name: str, value) -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flat_record(f"{name}/{k}", v))
        return out
    arr = np.asarray(value, np.float64)
    if arr.ndim == 0:
        return {name: _number(arr)}
    return {name: [_number(x) for x in arr.reshape(-1)]}


def stack_depth(mcfg) -> int:
    """The number of layers whose statistics a model's ``stats`` hold (an encoder-decoder:
    the encoder's, then the decoder's)."""
    if mcfg.arch == "encoder_decoder":
        return int(mcfg.n_layers) + int(mcfg.n_decoder_layers)
    return int(mcfg.n_layers)


class LayerStatistic(Metric):
    """A per-layer figure read from one of the statistics the stack collects (the one
    ``needs`` names): its entry ``total``, or under ``reduce="mean"`` the pair ``(total,
    count)``. The attention and residual metrics are each one of these and a docstring."""

    total: ClassVar[str]
    count: ClassVar[str | None] = None

    def shape(self, mcfg):
        return (stack_depth(mcfg),)

    def value(self, view):
        (stat,) = self.needs
        s = view.out.stats[stat]
        return s[self.total] if self.count is None else (s[self.total], s[self.count])
