"""Registered step metrics and auxiliary losses (the contract: ``attnlab.metrics.base``).

``register_metric(name)`` adds one; ``train.metrics`` selects them by name and
``train.loss_weights.<name>`` sets the weight of one that joins the objective. The
built-ins (one file each, imported on first use) are off unless selected, except those a
model implies:

=====================  ======  ==================================================================
name                   reduce  value
=====================  ======  ==================================================================
attn_max_logit         max     per layer: the largest scaled ``q . k`` (before cap and bias)
attn_qk_norm           max     per layer: max over heads of ``|W_q,n|_F |W_k,n|_F x scale``
attn_entropy           mean    per layer: the softmax entropy per (row, head, query), nats
attn_first_share       mean    per layer: the weight on the first key per (row, head, query)
residual_rms           mean    per layer: the residual stream's RMS after the layer
residual_max           max     per layer: the residual stream's largest absolute value
grad_norms             mean    per parameter group: the gradient's L2 norm
update_norms           mean    per parameter group: the optimiser update's L2 norm
moe_load_balance       mean    the load-balancing losses summed over the MoE layers (a loss)
moe_z_loss             mean    the router z-losses summed over the MoE layers (a loss)
moe_router             sum     the assignments per expert and the dropped ones
mtp                    mean    per depth: the multi-token-prediction cross-entropy (a loss)
dsa_indexer            mean    the indexers' KL per query, summed over the DSA layers (a loss)
=====================  ======  ==================================================================
"""

from attnlab.metrics.base import Metric, StepView, flat_record, stack_depth  # noqa: F401
from attnlab.metrics.registry import (  # noqa: F401  (read as attnlab.metrics.*)
    LOSS_METRICS,
    build,
    check,
    get_metric,
    loss_weight,
    records,
    register_metric,
    registered_metrics,
    selected_names,
)
