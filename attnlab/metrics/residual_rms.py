"""``residual_rms``: per layer, the root mean square of the residual stream after the layer
(over rows, positions and features; micro-batches and steps average the mean square),
as nanodo logs per layer for the instability study of Wortsman et al. 2024."""

import numpy as np

from attnlab.metrics import register_metric
from attnlab.metrics.base import LayerStatistic, flat_record


@register_metric("residual_rms")
class ResidualRMS(LayerStatistic):
    needs = ("residual",)
    reduce = "mean"
    total, count = "sq_sum", "count"

    def record(self, value):
        return flat_record(self.name, np.sqrt(value))
