"""``residual_rms``: per layer, the root mean square of the residual stream after the layer
(over rows, positions and features; micro-batches and steps average the mean square),
as nanodo logs per layer for the instability study of Wortsman et al. 2024."""

import numpy as np

from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric, flat_record, stack_depth


@register_metric("residual_rms")
class ResidualRMS(Metric):
    needs = ("residual",)
    reduce = "mean"

    def shape(self, mcfg):
        return (stack_depth(mcfg),)

    def value(self, view):
        r = view.out.stats["residual"]
        return r["sq_sum"], r["count"]

    def record(self, value):
        return flat_record(self.name, np.sqrt(value))
