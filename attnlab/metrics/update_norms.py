"""``update_norms``: per parameter group (``groups.GROUPS``: embed, head, mtp, norm, attn,
ffn, other), the L2 norm of the optimiser's update (the change the step makes to the parameters),
averaged over the steps of a log line."""

from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric
from attnlab.metrics.groups import group_names, group_norms


@register_metric("update_norms")
class UpdateNorms(Metric):
    phase = "update"
    reduce = "mean"

    def shape(self, mcfg):
        return dict.fromkeys(group_names(self.abstract_params), ())

    def value(self, view):
        return group_norms(view.updates, group_names(self.abstract_params)), 1.0
