"""``moe_router``: the assignments each expert received (summed over the MoE layers) and the
dropped ones (0: dispatch is dropless), summed over micro-batches and steps. The log line
shows each expert's share (``moe_tokens_per_expert``), the largest (``moe_max_expert_share``)
and ``moe_dropped``."""

import jax.numpy as jnp
import numpy as np

from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric
from attnlab.metrics.moe_load_balance import MoELoadBalance, is_moe


@register_metric("moe_router")
class MoERouter(Metric):
    reduce = "sum"

    @classmethod
    def implied(cls, mcfg):
        return is_moe(mcfg)

    check = MoELoadBalance.check

    def shape(self, mcfg):
        return {"tokens_per_expert": (int(mcfg.ffn_settings.n_experts),), "dropped": ()}

    def value(self, view):
        aux = view.out.aux
        return {
            "tokens_per_expert": jnp.sum(aux["tokens_per_expert"], axis=0).astype(self.dtype),
            "dropped": jnp.sum(aux["dropped"]).astype(self.dtype),
        }

    def record(self, value):
        counts = np.asarray(value["tokens_per_expert"], np.float64)
        share = counts / max(counts.sum(), 1.0)
        return {
            "moe_tokens_per_expert": [round(float(x), 5) for x in share],
            "moe_max_expert_share": float(share.max()),
            "moe_dropped": int(value["dropped"]),
        }
