"""Model-agnostic generation loops: phases over the cache, sampling and beam search.

A loop sees only a step function ``(tokens_BT, cache) -> (logits_BTV, cache)`` and a cache
with ``capacity``, ``batch_size``, ``lengths`` and ``replace(lengths=...)``: the KV cache of
``attnlab.kv_cache``, or the token buffer of ``attnlab.decode.recompute``. Nothing in it
depends on the architecture, and nothing recompiles per token or per sampling setting.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from attnlab import kv_cache
from attnlab.decode.sampling import SamplingConfig, sample
from attnlab.ops.precision import wide


def phases(capacity: int, smallest: int = 128, most: int = 4) -> list[int]:
    """Cache sizes a generation loop runs through: ``capacity`` halved up to ``most - 1``
    times, no size below ``smallest`` (small caches run in one phase)."""
    sizes = [capacity >> i for i in range(most - 1, -1, -1)]
    return [s for s in sizes if s >= smallest] or [capacity]


def while_in_phases(cond, body, state, next_slot, *, phased=True, split=False):
    """``lax.while_loop(cond, body, state)``, run over growing prefixes of ``state.cache``.

    Each step's attention reads only the current prefix, so its cost follows the sequence
    length (to a factor of 2) rather than the capacity, in one static program. Phase ``i``
    runs while ``next_slot(state)`` (the largest index a step writes) fits its prefix; the
    prefix is copied out of the full cache once and pasted back once, and a phase the loop
    never reaches is skipped (``lax.cond``), copies included. ``phased=False`` (a cache that
    is not a ``KVCache``) runs one plain loop, as does a ring buffer: it holds only its
    window's slots, and they are not positions.

    ``split``: the steps run separate blocks (``Stack.unstack``), so each phase holds one
    array per layer (``kv_cache.split_layers``), cut from the full cache in the same copy as
    its prefix: a block then reads its layer where it lies instead of copying it out of
    the stacked arrays at every step. The returned cache is stacked again.
    """
    is_kv = isinstance(state.cache, kv_cache.KVCache)
    phased = phased and is_kv and not state.cache.ring
    split = split and is_kv
    capacity = state.cache.capacity
    for size in phases(capacity) if phased else [capacity]:
        last = size == capacity

        def run(state, size=size, last=last):
            full = state.cache
            part = full if last else kv_cache.truncate(full, size, split=split)
            if last and split:
                part = kv_cache.split_layers(part)
            go = cond if last else (lambda s: cond(s) & (next_slot(s) < size))
            state = jax.lax.while_loop(go, body, state.replace(cache=part))
            if last:
                return state.replace(cache=kv_cache.join_layers(state.cache)) if split else state
            return state.replace(cache=kv_cache.paste(full, state.cache))

        if not phased:
            return run(state)
        enter = cond(state) if last else cond(state) & (next_slot(state) < size)
        state = jax.lax.cond(enter, run, lambda s: s, state)
    return state


@struct.dataclass
class SampleState:
    step: jax.Array  # int32: tokens emitted so far
    token_B: jax.Array  # the last emitted token, the next model input
    cache: Any
    tokens_BS: jax.Array  # emitted ids, pad after a row stops
    logits_BSV: jax.Array | None
    count_B: jax.Array  # tokens emitted per row, EOS included
    eos_B: jax.Array  # the row emitted EOS
    done_B: jax.Array  # the row has stopped


def sample_loop(
    step_fn,
    logits_BV,
    cache,
    key,
    max_new,
    eos_id,
    pad_id,
    sampling: SamplingConfig,
    *,
    return_logits: bool,
    phased: bool = True,
    split: bool = False,
) -> dict:
    """Samples up to ``max_new`` tokens per row after a prefill that gave ``logits_BV``.

    ``eos_id < 0`` means no EOS. Row ``b`` may emit at most ``S - cache.lengths[b]`` tokens.
    Returns ``tokens_BS`` (pad after a row stops), ``logits_BSV`` (or None), ``count_B``,
    ``eos_B`` and the ``cache``.
    """
    B, S = cache.batch_size, cache.capacity
    limit_B = jnp.minimum(max_new, S - cache.lengths)

    def emit(state, logits_BV):
        i, zero = state.step, jnp.int32(0)  # int32 indices, also under JAX's 64-bit mode
        live_B = ~state.done_B
        token_B = sample(logits_BV, jax.random.fold_in(key, i), sampling)
        token_B = jnp.where(live_B, token_B, pad_id)
        eos_B = live_B & (token_B == eos_id)
        count_B = state.count_B + live_B.astype(jnp.int32)
        logits_BSV = state.logits_BSV
        if return_logits:
            logits_BSV = jax.lax.dynamic_update_slice(
                logits_BSV, logits_BV[:, None], (zero, i, zero)
            )
        return state.replace(
            step=i + 1,
            token_B=token_B,
            tokens_BS=jax.lax.dynamic_update_slice(state.tokens_BS, token_B[:, None], (zero, i)),
            logits_BSV=logits_BSV,
            count_B=count_B,
            eos_B=state.eos_B | eos_B,
            done_B=state.done_B | eos_B | (count_B >= limit_B),
        )

    state = SampleState(
        step=jnp.int32(0),
        token_B=jnp.zeros((B,), jnp.int32),
        cache=cache,
        tokens_BS=jnp.full((B, S), pad_id, jnp.int32),
        logits_BSV=jnp.zeros((B, S, logits_BV.shape[-1]), logits_BV.dtype)
        if return_logits
        else None,
        count_B=jnp.zeros((B,), jnp.int32),
        eos_B=jnp.zeros((B,), bool),
        done_B=limit_B <= 0,
    )
    state = emit(state, logits_BV)

    def body(state):
        logits_BTV, cache = step_fn(state.token_B[:, None], state.cache)
        # Stopped rows keep their length: their pad input only rewrites one slot they no
        # longer need (unused in a linear cache, their oldest token in a ring buffer).
        cache = cache.replace(lengths=jnp.where(state.done_B, state.cache.lengths, cache.lengths))
        return emit(state.replace(cache=cache), logits_BTV[:, 0])

    state = while_in_phases(
        lambda s: (s.step < max_new) & ~jnp.all(s.done_B),
        body,
        state,
        lambda s: jnp.max(jnp.where(s.done_B, 0, s.cache.lengths)),
        phased=phased,
        split=split,
    )
    return {
        "tokens_BS": state.tokens_BS,
        "logits_BSV": state.logits_BSV,
        "count_B": state.count_B,
        "eos_B": state.eos_B,
        "cache": state.cache,
    }


@struct.dataclass
class BeamState:
    step: jax.Array  # int32: tokens in every alive beam
    token_BW: jax.Array  # the alive beams' last tokens, the next model input
    cache: Any  # B * W rows, beam w of row b at row b * W + w
    alive_BWS: jax.Array
    alive_lp_BW: jax.Array  # summed log-probabilities; -inf marks an empty beam
    best_BS: jax.Array  # the best finished (EOS-ended) hypothesis
    best_score_B: jax.Array  # its length-normalised score; -inf while none
    best_len_B: jax.Array


def beam_loop(
    step_fn, logits_BV, cache, max_new, eos_id, pad_id, length_penalty, *, num_beams, split=False
):
    """Beam search after a prefill that gave ``logits_BV``; scores are summed log-probs
    divided by ``length ** length_penalty`` (length = generated tokens, EOS included).

    Each row's prefilled cache is repeated ``num_beams`` times, so any prefix (a prompt, or
    a start token after an encoded source) works. Returns ``tokens_BS``, ``count_B``,
    ``eos_B``, ``score_B`` and the ``cache``.
    """
    B, S = cache.batch_size, cache.capacity
    W, V = num_beams, logits_BV.shape[-1]
    f = wide(logits_BV)  # the scores' dtype: float32, float64 for a float64 model

    def norm(length):
        return length.astype(f) ** length_penalty

    def expand(state, logp_BWV):
        i = state.step
        cand_BX = (state.alive_lp_BW[:, :, None] + logp_BWV).reshape(B, W * V)
        score_BC, flat_BC = jax.lax.top_k(cand_BX, 2 * W)  # enough to keep W non-EOS beams
        parent_BC, token_BC = flat_BC // V, (flat_BC % V).astype(jnp.int32)
        seqs_BCS = jnp.take_along_axis(state.alive_BWS, parent_BC[:, :, None], axis=1)
        seqs_BCS = jax.lax.dynamic_update_slice(seqs_BCS, token_BC[:, :, None], (0, 0, i))
        eos_BC = token_BC == eos_id

        alive_lp_BW, pick_BW = jax.lax.top_k(jnp.where(eos_BC, -jnp.inf, score_BC), W)
        take = lambda x: jnp.take_along_axis(x, pick_BW, axis=1)
        alive_BWS = jnp.take_along_axis(seqs_BCS, pick_BW[:, :, None], axis=1)
        parent_BW, token_BW = take(parent_BC), take(token_BC)

        fin_BC = jnp.where(eos_BC, score_BC / norm(i + 1), -jnp.inf)
        j_B = jnp.argmax(fin_BC, axis=1)
        fin_B = jnp.take_along_axis(fin_BC, j_B[:, None], axis=1)[:, 0]
        better_B = fin_B > state.best_score_B
        fin_BS = jnp.take_along_axis(seqs_BCS, j_B[:, None, None], axis=1)[:, 0]
        rows_B = (jnp.arange(B, dtype=jnp.int32)[:, None] * W + parent_BW).reshape(B * W)
        return state.replace(
            step=i + 1,
            token_BW=token_BW,
            cache=kv_cache.take_rows(state.cache, rows_B),
            alive_BWS=alive_BWS,
            alive_lp_BW=alive_lp_BW,
            best_BS=jnp.where(better_B[:, None], fin_BS, state.best_BS),
            best_score_B=jnp.where(better_B, fin_B, state.best_score_B),
            best_len_B=jnp.where(better_B, i + 1, state.best_len_B),
        )

    first_lp_BW = jnp.where(jnp.arange(W)[None] == 0, 0.0, -jnp.inf) * jnp.ones((B, 1))
    state = BeamState(
        step=jnp.int32(0),
        token_BW=jnp.zeros((B, W), jnp.int32),
        cache=kv_cache.repeat_rows(cache, W),
        alive_BWS=jnp.full((B, W, S), pad_id, jnp.int32),
        alive_lp_BW=first_lp_BW.astype(f),
        best_BS=jnp.full((B, S), pad_id, jnp.int32),
        best_score_B=jnp.full((B,), -jnp.inf, f),
        best_len_B=jnp.zeros((B,), jnp.int32),
    )
    logp_BV = jax.nn.log_softmax(logits_BV.astype(f), axis=-1)
    state = expand(state, jnp.broadcast_to(logp_BV[:, None], (B, W, V)))

    def cond(state):
        # An alive beam's score can only fall: stop once none can beat the best finished one.
        longest = jnp.where(length_penalty > 0, max_new, state.step)
        bound_B = jnp.max(state.alive_lp_BW, axis=1) / norm(longest)
        return (state.step < max_new) & ~jnp.all(bound_B <= state.best_score_B)

    def body(state):
        logits_BTV, cache = step_fn(state.token_BW.reshape(B * W, 1), state.cache)
        logp_BWV = jax.nn.log_softmax(logits_BTV[:, 0].astype(f), axis=-1)
        return expand(state.replace(cache=cache), logp_BWV.reshape(B, W, V))

    state = while_in_phases(cond, body, state, lambda s: jnp.max(s.cache.lengths), split=split)
    alive_score_BW = state.alive_lp_BW / norm(state.step)
    w_B = jnp.argmax(alive_score_BW, axis=1)
    alive_B = jnp.take_along_axis(alive_score_BW, w_B[:, None], axis=1)[:, 0]
    use_fin_B = state.best_score_B >= alive_B
    alive_BS = jnp.take_along_axis(state.alive_BWS, w_B[:, None, None], axis=1)[:, 0]
    return {
        "tokens_BS": jnp.where(use_fin_B[:, None], state.best_BS, alive_BS),
        "count_B": jnp.where(use_fin_B, state.best_len_B, state.step),
        "eos_B": use_fin_B,
        "score_B": jnp.where(use_fin_B, state.best_score_B, alive_B),
        "cache": state.cache,
    }
