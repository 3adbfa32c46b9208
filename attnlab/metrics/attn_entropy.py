"""``attn_entropy``: per layer, the mean softmax entropy (nats) over rows, heads and queries
that attend to something; a sink's share counts as one more outcome. Entropy collapse
(Zhai et al. 2023) shows as this figure falling towards 0."""

from attnlab.metrics import register_metric
from attnlab.metrics.base import LayerStatistic


@register_metric("attn_entropy")
class AttnEntropy(LayerStatistic):
    needs = ("attention",)
    reduce = "mean"
    total, count = "entropy_sum", "rows"
