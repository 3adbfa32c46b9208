"""``grad_norms``: per parameter group (``groups.GROUPS``: embed, head, mtp, norm, attn,
ffn, other), the L2 norm of the step's gradient (per counted token, before clipping),
averaged over the steps of a log line."""

from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric
from attnlab.metrics.groups import group_names, group_norms


@register_metric("grad_norms")
class GradNorms(Metric):
    phase = "update"
    reduce = "mean"

    def shape(self, mcfg):
        return dict.fromkeys(group_names(self.abstract_params), ())

    def value(self, view):
        return group_norms(view.grads, group_names(self.abstract_params)), 1.0
