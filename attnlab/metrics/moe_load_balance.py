"""``moe_load_balance``: the Switch Transformer load-balancing loss of a mixture of experts,
summed over its MoE layers, averaged over micro-batches and steps. A loss: it joins the
objective with ``train.loss_weights.moe_load_balance``, by default the FFN's
``ffn_settings.load_balance_weight``. On for every MoE model."""

import jax.numpy as jnp

from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric


def is_moe(mcfg) -> bool:
    return getattr(getattr(mcfg, "ffn_settings", None), "n_experts", None) is not None


@register_metric("moe_load_balance")
class MoELoadBalance(Metric):
    reduce = "mean"
    aux_key = "load_balance"
    weight_field = "load_balance_weight"

    @classmethod
    def implied(cls, mcfg):
        return is_moe(mcfg)

    @classmethod
    def check(cls, mcfg):
        if not is_moe(mcfg):
            from attnlab.errors import ConfigError

            raise ConfigError(
                f"train.metrics names {cls.name!r}, which needs a mixture of experts: set "
                "model.ffn_variant='moe' or remove it"
            )

    @classmethod
    def default_weight(cls, mcfg):
        return float(getattr(mcfg.ffn_settings, cls.weight_field)) if is_moe(mcfg) else None

    def value(self, view):
        aux = view.out.aux or {}
        return jnp.sum(aux[self.aux_key]).astype(self.dtype), 1.0
