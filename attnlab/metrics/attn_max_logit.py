"""``attn_max_logit``: per layer, the largest pre-softmax logit (scaled ``q . k``, before any
cap or bias) over the batch, heads and allowed pairs; the largest over micro-batches and
steps. Logits that grow without bound precede attention-entropy collapse (Wortsman et al.
2024; levanter's attention-instability callback logs the same figure)."""

from attnlab.metrics import register_metric
from attnlab.metrics.base import LayerStatistic


@register_metric("attn_max_logit")
class AttnMaxLogit(LayerStatistic):
    needs = ("attention",)
    reduce = "max"
    total = "max_logit"
