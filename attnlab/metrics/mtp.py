"""``mtp``: multi-token prediction (DeepSeek-V3), per depth ``k`` the cross-entropy of the
MTP module's prediction of the token ``k + 1`` ahead (``attnlab.nn.mtp``), over the counted
tokens whose target lies inside the sequence (and inside the same document of a packed
row). A loss: the objective is ``main + λ mean_k CE_k`` with ``λ =
train.loss_weights.mtp`` (default 0.3, DeepSeek-V3's weight for its first 10T tokens).
On whenever ``model.mtp_depth > 0``; logged as ``mtp_loss_1`` ... ``mtp_loss_K``."""

import jax.numpy as jnp
import numpy as np
import optax

from attnlab.errors import ConfigError
from attnlab.metrics import register_metric
from attnlab.metrics.base import Metric
from attnlab.nn.mtp import shifted


@register_metric("mtp")
class MultiTokenPrediction(Metric):
    reduce = "mean"
    loss_weight = 0.3

    @classmethod
    def implied(cls, mcfg):
        return bool(getattr(mcfg, "mtp_depth", 0))

    @classmethod
    def check(cls, mcfg):
        if not getattr(mcfg, "mtp_depth", 0):
            raise ConfigError(
                "train.metrics names 'mtp', but model.mtp_depth=0: set "
                "--config.model.mtp_depth=1 (or more) or remove it"
            )

    def shape(self, mcfg):
        return (int(mcfg.mtp_depth),)

    def value(self, view):
        if view.kind != "lm":
            raise ConfigError(
                f"model.mtp_depth trains a language model, not data kind {view.kind!r}"
            )
        batch = view.batch
        segments = batch.get("segment_ids")
        logits = view.model.mtp_logits(
            view.out.hidden, batch["inputs"], positions_BT=batch.get("positions"),
            segment_ids_BT=segments, key=view.key,
        )  # fmt: skip
        sums, counts = [], []
        for k, logits_BTV in enumerate(logits, start=1):
            mask_BT = shifted(view.mask, k, 0.0)
            if segments is not None:  # the target in the same document
                mask_BT = mask_BT * (shifted(segments, k, -1) == segments)
            ce_BT = optax.softmax_cross_entropy_with_integer_labels(
                logits_BTV, shifted(view.targets, k)
            )
            sums.append(jnp.sum(ce_BT * mask_BT))
            counts.append(jnp.sum(mask_BT))
        return jnp.stack(sums), jnp.stack(counts)

    def as_loss(self, value):
        return jnp.mean(value)

    def record(self, value):
        return {f"mtp_loss_{k}": float(v) for k, v in enumerate(np.asarray(value), start=1)}
