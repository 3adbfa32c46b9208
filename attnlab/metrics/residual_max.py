"""``residual_max``: per layer, the largest absolute value of the residual stream after the
layer (the outlier features that gated attention removes, Qiu et al. 2025)."""

from attnlab.metrics import register_metric
from attnlab.metrics.base import LayerStatistic


@register_metric("residual_max")
class ResidualMax(LayerStatistic):
    needs = ("residual",)
    reduce = "max"
    total = "max_abs"
