"""Training primitives: objectives, the optimiser, and the pure steps jitted once by ``Trainer``.

The loop that drives them (work directories, checkpoints, logs, stacked trials) is
``attnlab.runs``.
"""

from attnlab import _moved
from attnlab.train.objectives import loss_sums, model_logits
from attnlab.train.optim import (
    NO_DECAY_NAMES,
    decay_mask,
    injected_hyperparams,
    learning_rate,
    lr_multiplier,
    make_optimizer,
    set_optim_values,
)
from attnlab.train.state import zeros_acc
from attnlab.train.steps import Trainer

__all__ = [
    "NO_DECAY_NAMES",
    "Trainer",
    "decay_mask",
    "injected_hyperparams",
    "learning_rate",
    "loss_sums",
    "lr_multiplier",
    "make_optimizer",
    "model_logits",
    "set_optim_values",
    "zeros_acc",
]


__getattr__ = _moved.module_getattr(__name__)  # the previous release's names, deprecated
