"""``moe_z_loss``: the router z-loss (ST-MoE) of a mixture of experts, summed over its MoE
layers, averaged over micro-batches and steps. A loss: it joins the objective with
``train.loss_weights.moe_z_loss``, by default ``ffn_settings.z_loss_weight``."""

from attnlab.metrics import register_metric
from attnlab.metrics.moe_load_balance import MoELoadBalance


@register_metric("moe_z_loss")
class MoEZLoss(MoELoadBalance):
    aux_key = "z_loss"
    weight_field = "z_loss_weight"
