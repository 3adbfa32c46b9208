"""``attn_first_share``: per layer, the mean attention weight on each row's first key
(position 0 of the row), over rows, heads and queries: the "attention sink" of Xiao et al.
2024, which Qiu et al. 2025 find a head-wise output gate removes."""

from attnlab.metrics import register_metric
from attnlab.metrics.base import LayerStatistic


@register_metric("attn_first_share")
class AttnFirstShare(LayerStatistic):
    needs = ("attention",)
    reduce = "mean"
    total, count = "first_sum", "rows"
