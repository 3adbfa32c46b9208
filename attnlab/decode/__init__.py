"""Generation: model-agnostic loops, the compiled decoder, input checks and ``generate``.

Conventions:

* A model is split once (``nnx.split``); every jitted function takes the parameter state as
  its first argument and merges it inside, so new weights never recompile. ``Decoder``
  (``compiled``) holds the jitted functions of one model graph, and is shared by every
  model of that graph; a ``Pretrained`` handle is split when it is made.
* The loops (``loops``) see only a step function ``(tokens_BT, cache) -> (logits_BTV,
  cache)`` and a cache; nothing in them depends on the architecture. ``prefill`` runs a
  whole right-padded prompt in one pass; ``decode_step`` appends one token per row. Beam
  search repeats each prefilled row ``num_beams`` times, for either architecture.
* Static shapes: the cache gets the smallest loop phase (below) that holds prompt + new
  tokens, up to the capacity (``max_len``, default ``ModelConfig.max_len``;
  ``api.cache_slots``), and that size ``S`` fixes every shape; ``max_new_tokens``, the
  special ids and every sampling setting (temperature, top-k, top-p, min-p) are traced
  scalars and generated ids go to a ``[B, S]`` buffer, so generations of any length, hot
  or greedy, share at most ``len(phases(max_len))`` compiled programs (one below 256
  slots). Prompts are padded to the next power of two (at least 16) so prompt lengths
  share programs too. A smaller ``max_len`` gives a smaller cache and faster compiles.
* ``unstacked(model)``: a model that will only generate, with its decoder's layers held
  as separate blocks, so no call copies weights out of the stacked layout.
* Phases: a loop over a large cache runs over growing prefixes of it (``phases``: the
  capacity halved up to three times, none below 128 slots), so a step's attention reads
  about as much cache as the sequence needs, not the whole capacity, in the same program.
  A ring-buffer cache (``attnlab.kv_cache``: W slots for a model whose every layer slides
  with window W, the default for such a model when ``max_len`` exceeds W) runs in one phase;
  its memory stays W slots however long the generation.
* Prefill: a prompt longer than ``compiled.PREFILL_CHUNK`` (1024) tokens, or than
  ``prefill_chunk``, goes through the cache in chunks, so no ``[T, T]`` scores are formed.
* Ragged batches: row ``b`` has ``prompt_lengths[b]`` real tokens; its ``i``-th new token sits
  at position ``prompt_lengths[b] + i``. A row stops at its own EOS (and then emits
  ``pad_id``) or after ``max_new_tokens``; stopped rows no longer move in the cache.
* Capacity: a row's whole sequence (prompt + new tokens; for encoder-decoder models the
  start token + new tokens) must fit in the cache's ``max_len`` positions (a ring buffer
  serves them with fewer slots). Too long raises a ``ValueError`` before
  any computation (``checks``), unless ``on_overflow="stop"``, where such rows stop with
  reason ``"capacity"``.
* Recomputation (``recompute``) runs the same sampling loop over a token buffer instead of
  a cache: the reference for any decoder, and the only exact way for a non-causal one.
* Randomness: ``jax.random.key(seed)``, folded with the step index (``sampling``).
"""

from attnlab.decode.api import STOP_REASONS, GenerationResult, generate
from attnlab.decode.checks import check_ids
from attnlab.decode.compiled import Decoder, unstacked
from attnlab.decode.loops import beam_loop, phases, sample_loop, while_in_phases
from attnlab.decode.options import Beams, CacheOptions, GenerateOptions, Stopping
from attnlab.decode.sampling import (
    SamplingConfig,
    filter_logits,
    min_p_filter,
    sample,
    top_k_filter,
    top_p_filter,
)

__all__ = [
    "STOP_REASONS",
    "Beams",
    "CacheOptions",
    "Decoder",
    "GenerateOptions",
    "GenerationResult",
    "SamplingConfig",
    "Stopping",
    "beam_loop",
    "check_ids",
    "filter_logits",
    "generate",
    "min_p_filter",
    "phases",
    "sample",
    "sample_loop",
    "top_k_filter",
    "top_p_filter",
    "unstacked",
    "while_in_phases",
]
