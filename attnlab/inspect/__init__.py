"""Look inside a model: capture and patch its named intermediates.

Every intermediate has a stable name (``attnlab.nn.probe``): per layer ``i`` of a stack,

* ``layers.{i}.resid_pre`` / ``resid_mid`` / ``resid_cross`` / ``resid_post``: the residual
  stream ``[B, T, D]`` before the layer, after its mixers, after cross-attention, after it;
* ``layers.{i}.attn.q`` ``[B, T, N, H]``, ``attn.k`` and ``attn.v`` ``[B, S, K, H]``,
  ``attn.z`` (each head's output) ``[B, T, N, H]``, ``attn.out`` ``[B, T, D]``, and
  read-only ``attn.scores`` and ``attn.weights`` ``[B, N, T, S]`` (float32);
  ``cross_attn.*`` the same for cross-attention; ``attn.{m}.*`` with several mixers;
* ``layers.{i}.attn.state``: a recurrent mixer's final state (read-only);
* ``layers.{i}.ffn.hidden`` ``[B, T, F]`` (after the activation), ``ffn.out``, and an MoE
  layer's read-only ``ffn.router.logits`` ``[B, T, E]``, ``router.choices`` and
  ``router.gates`` ``[B, T, top_k]``;

prefixed ``encoder.``/``decoder.`` in an encoder-decoder. ``names(model, tokens)`` lists a
model's names with their shapes.

``run(model, tokens, capture=[...], patches=[...])`` runs the model jitted with the
selected names captured and the patches applied (``replace``, ``add``, ``zero``,
``mean_ablate``); ``patching_sweep`` sweeps a patch over layers x positions or heads into a
``PatchingTable`` (a table and a heat map); ``logit_lens`` reads every layer's residual
stream through the final norm and the unembedding. ``Probe`` does the same inside a
function of your own (``with Probe(capture) as p: model(x)``, then ``p.captured``).
"""

from attnlab.inspect.capture import MAX_BYTES, Captured, Cost, cost, model_of, names, run
from attnlab.inspect.lens import logit_lens
from attnlab.inspect.patching import (
    PatchingTable,
    add,
    mean_ablate,
    patching_sweep,
    replace,
    zero,
)
from attnlab.nn.probe import Patch, Probe, Seen

__all__ = [
    "MAX_BYTES",
    "Captured",
    "Cost",
    "Patch",
    "PatchingTable",
    "Probe",
    "Seen",
    "add",
    "cost",
    "logit_lens",
    "mean_ablate",
    "model_of",
    "names",
    "patching_sweep",
    "replace",
    "run",
    "zero",
]
