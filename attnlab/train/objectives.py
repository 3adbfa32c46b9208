"""Objectives: a model's logits for a batch of each task kind, and the masked cross-entropy.

Batches are dicts of arrays. ``lm``: ``inputs``, ``targets``, ``loss_mask`` ``[B, T]``;
``mlm`` adds ``valid``; ``seq2seq``: ``src``, ``src_valid`` ``[B, S]`` and ``tgt_in``,
``tgt_out``, ``loss_mask`` ``[B, T]``. Losses are sums over counted tokens, so micro-batches
and trials can be added before normalising once.

The train step's other terms (a mixture of experts' load-balancing and router z-losses,
multi-token prediction) are registered metrics with a loss weight
(``attnlab.metrics``), added per counted token; the reported loss stays the
cross-entropy. ``objective_sums`` returns the FFN's report (``aux``) beside the sums.

Token ids are checked on the host where the batch is visible (``check_batch_ids``): a target
outside ``[0, vocab_size)`` would make the cross-entropy NaN (the label's logit is gathered
out of range) and the step's loss with it. ``loss_sums`` and ``objective_sums`` check a
concrete batch; the ``Trainer``'s steps check each batch they are given; a batch traced by
a caller's own ``jit`` is the caller's to check (``check_batch_ids`` before the call).
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from attnlab.errors import TokenIdError
from attnlab.ops.precision import wide

# The batch fields that hold token ids, per task kind (``attnlab.data.tasks`` writes them).
ID_FIELDS = {
    "lm": ("inputs", "targets"),
    "mlm": ("inputs", "targets"),
    "seq2seq": ("src", "tgt_in", "tgt_out"),
}


def check_batch_ids(batch, kind: str, vocab_size: int) -> None:
    """Raises a ``TokenIdError`` naming the field, the id and its index when a concrete
    batch of ``kind`` holds a token id outside ``[0, vocab_size)`` (padding included: give
    padded targets a valid id and ``loss_mask`` 0). Traced fields are not checked."""
    for field in ID_FIELDS.get(kind, ()):
        x = batch.get(field) if hasattr(batch, "get") else None
        if x is None or isinstance(x, jax.core.Tracer):
            continue
        ids = np.asarray(x)  # a device array is copied to the host
        if ids.size == 0 or (ids.min() >= 0 and ids.max() < vocab_size):
            continue
        index = tuple(int(i) for i in np.argwhere((ids < 0) | (ids >= vocab_size))[0])
        raise TokenIdError(
            f"batch[{field!r}]: id {int(ids[index])} at index {index} is outside [0, "
            f"model.vocab_size={vocab_size}) (its cross-entropy would be NaN): map the ids into "
            "the vocabulary (padding: a valid id with loss_mask 0), or raise model.vocab_size"
        )


def model_output(model, batch, kind, key=None, collect=()):
    """The ``ModelOutput`` and the matching (targets, loss mask) for a batch of ``kind``;
    ``collect`` names the per-layer statistics the model returns in ``stats``."""
    asked = {"collect": tuple(collect)} if collect else {}
    if kind == "lm":
        packed = {f"{k}_BT": batch[k] for k in ("segment_ids", "positions") if k in batch}
        out = model(batch["inputs"], key=key, **packed, **asked)  # packed rows: kept apart
        return out, batch["targets"], batch["loss_mask"]
    if kind == "mlm":
        out = model(batch["inputs"], valid_BT=batch["valid"], key=key, **asked)
        return out, batch["targets"], batch["loss_mask"]
    if kind == "seq2seq":
        src, valid = batch["src"], batch["src_valid"]
        out = model(src, batch["tgt_in"], src_valid_BS=valid, key=key, **asked)
        return out, batch["tgt_out"], batch["loss_mask"]
    raise ValueError(f"unknown task kind {kind!r}")


def model_logits(model, batch, kind, key=None):
    """Logits and the matching (targets, loss mask) for a batch of ``kind``."""
    out, targets, mask = model_output(model, batch, kind, key)
    return out.logits, targets, mask


def loss_sums(model, batch, kind, key=None):
    """Summed masked cross-entropy and the number of counted tokens."""
    s, n, extras, _ = objective_sums(model, batch, kind, key)
    return s, n, extras


def objective_sums(model, batch, kind, key=None):
    """``(ce_sum, tokens, (logits, targets, mask), aux)``: the summed cross-entropy as in
    ``loss_sums`` and the FFN's report (None without one); ``ce_sum + tokens *
    aux["loss"]`` is the objective to differentiate."""
    check_batch_ids(batch, kind, model.cfg.vocab_size)
    out, targets_BT, mask_BT = model_output(model, batch, kind, key)
    logits_BTV = out.logits
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
    mask_BT = mask_BT.astype(wide(logits_BTV))  # float64 for a float64 model
    return (ce_BT * mask_BT).sum(), mask_BT.sum(), (logits_BTV, targets_BT, mask_BT), out.aux
