"""``update_norms``: per parameter group (``groups.GROUPS``: embed, head, mtp, norm, attn,
ffn, other), the L2 norm of the optimiser's update (the change the step makes to the parameters),
averaged over the steps of a log line."""

from attnlab.metrics import register_metric
from attnlab.metrics.groups import GroupNorms


@register_metric("update_norms")
class UpdateNorms(GroupNorms):
    of = "updates"
