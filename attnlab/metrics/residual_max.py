"""``residual_max``: per layer, the largest absolute value of the residual stream after the
layer (the outlier features that gated attention removes, Qiu et al. 2025)."""

from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric, stack_depth


@register_metric("residual_max")
class ResidualMax(Metric):
    needs = ("residual",)
    reduce = "max"

    def shape(self, mcfg):
        return (stack_depth(mcfg),)

    def value(self, view):
        return view.out.stats["residual"]["max_abs"]
