"""``dsa_indexer``: the lightning indexer's loss of DeepSeek Sparse Attention
(``mixer="dsa"``, ``attnlab.nn.mixers.sparse``), ``KL(p || softmax(I))`` per query summed
over the sparse layers, averaged per query (micro-batches and steps alike). A loss: it joins
the objective with ``train.loss_weights.dsa_indexer``, by default the mixer's
``mixer_settings.indexer_loss_weight``; the indexer reads its inputs with their gradients
stopped, so the term trains the indexer alone. On for every model with such a layer."""

import jax.numpy as jnp

from attnlab.config.layer_kinds import stack_plan
from attnlab.errors import ConfigError
from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric

WEIGHT_FIELD = "indexer_loss_weight"


def indexer_settings(mcfg) -> list:
    """The settings of the stack's mixers that train an indexer (those with a weight)."""
    if not hasattr(mcfg, "mixer_settings"):
        return []
    n = getattr(mcfg, "stack_layers", getattr(mcfg, "n_layers", 0))
    specs = stack_plan(mcfg, n).mixer_specs
    return [s.mixer_settings for s in specs if hasattr(s.mixer_settings, WEIGHT_FIELD)]


@register_metric("dsa_indexer")
class DSAIndexer(Metric):
    needs = ("indexer_kl",)
    reduce = "mean"

    @classmethod
    def implied(cls, mcfg):
        return bool(indexer_settings(mcfg))

    @classmethod
    def check(cls, mcfg):
        if not indexer_settings(mcfg):
            raise ConfigError(
                "train.metrics names 'dsa_indexer', which needs a sparse-attention layer: "
                "set model.mixer='dsa' or remove it"
            )

    @classmethod
    def default_weight(cls, mcfg):
        found = indexer_settings(mcfg)
        return float(getattr(found[0], WEIGHT_FIELD)) if found else None

    def value(self, view):
        s = view.out.stats["indexer_kl"]
        return jnp.sum(s["kl_sum"]), jnp.maximum(jnp.max(s["rows"]), 1.0)
