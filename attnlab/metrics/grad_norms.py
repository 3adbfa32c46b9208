"""``grad_norms``: per parameter group (``groups.GROUPS``: embed, head, mtp, norm, attn,
ffn, other), the L2 norm of the step's gradient (per counted token, before clipping),
averaged over the steps of a log line."""

from attnlab.metrics import register_metric
from attnlab.metrics.groups import GroupNorms


@register_metric("grad_norms")
class GradNorms(GroupNorms):
    of = "grads"
