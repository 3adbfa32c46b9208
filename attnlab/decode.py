"""Generation with an explicit KV cache: prefill, decode step, sampling and beam-search loops.

Conventions:

* A model is split once (``nnx.split``); every jitted function takes the parameter state as
  its first argument and merges it inside, so new weights never recompile. ``Decoder``
  holds the jitted functions of one model graph, and is shared by every model of that graph.
* The loops see only a step function ``(tokens_BT, cache) -> (logits_BTV, cache)`` and a
  ``KVCache``; nothing in them depends on the architecture. ``prefill`` runs a whole
  right-padded prompt in one pass; ``decode_step`` appends one token per row.
* Static shapes: the cache capacity ``S`` (``max_len``, default ``ModelConfig.max_len``)
  fixes every shape; ``max_new_tokens`` is a traced scalar and generated ids go to a
  ``[B, S]`` buffer, so generating 10 or 1000 tokens runs the same compiled programs.
  Prompts are padded to the next power of two (at least 16) so prompt lengths share
  programs too. A smaller ``max_len`` gives a smaller cache and faster compiles.
* Phases: a loop over a large cache runs over growing prefixes of it (``phases``: the
  capacity halved up to three times, none below 128 slots), so a step's attention reads
  about as much cache as the sequence needs, not the whole capacity, in the same program.
* Ragged batches: row ``b`` has ``prompt_lengths[b]`` real tokens; its ``i``-th new token sits
  at position ``prompt_lengths[b] + i``. A row stops at its own EOS (and then emits
  ``pad_id``) or after ``max_new_tokens``; stopped rows no longer move in the cache.
* Capacity: a row's whole sequence (prompt + new tokens; for encoder-decoder models the
  start token + new tokens) must fit in the cache. Too long raises a ``ValueError`` before
  any computation, unless ``on_overflow="stop"``, where such rows stop with reason
  ``"capacity"``.
* Randomness: ``jax.random.key(seed)``, folded with the step index (``attnlab.sampling``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from attnlab import kv_cache
from attnlab.config import ModelConfig
from attnlab.kv_cache import KVCache
from attnlab.sampling import SamplingConfig, sample

STOP_REASONS = ("eos", "max_new_tokens", "capacity")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What ``generate`` / ``generate_seq2seq`` return (NumPy arrays on the host)."""

    tokens: np.ndarray  # [B, N] generated ids; pad_id after a row stops
    sequences: list  # per row: prompt (or start token) + generated ids, cut after EOS
    lengths: np.ndarray  # [B] generated tokens per row, EOS included
    stop_reason: list  # per row: "eos" | "max_new_tokens" | "capacity"
    logits: np.ndarray | None = None  # [B, N, V] the logits each token was chosen from
    scores: np.ndarray | None = None  # [B] beam search: the length-normalised log-prob


# ------------------------------------------------------------------------------------------
# Model-agnostic loops
# ------------------------------------------------------------------------------------------


def phases(capacity: int, smallest: int = 128, most: int = 4) -> list[int]:
    """Cache sizes a generation loop runs through: ``capacity`` halved up to ``most - 1``
    times, no size below ``smallest`` (small caches run in one phase)."""
    sizes = [capacity >> i for i in range(most - 1, -1, -1)]
    return [s for s in sizes if s >= smallest] or [capacity]


def while_in_phases(cond, body, state, next_slot):
    """``lax.while_loop(cond, body, state)``, run over growing prefixes of ``state.cache``.

    Each step's attention reads only the current prefix, so its cost follows the sequence
    length (to a factor of 2) rather than the capacity, in one static program. Phase ``i``
    runs while ``next_slot(state)`` (the largest index a step writes) fits its prefix; the
    prefix is copied out of the full cache once and pasted back once.
    """
    full = state.cache
    for size in phases(full.capacity):
        if size == full.capacity:
            return jax.lax.while_loop(cond, body, state.replace(cache=full))
        state = jax.lax.while_loop(
            lambda s, size=size: cond(s) & (next_slot(s) < size),
            body,
            state.replace(cache=kv_cache.truncate(full, size)),
        )
        full = kv_cache.paste(full, state.cache)
    raise AssertionError("phases() always ends with the full capacity")


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
    step_fn, logits_BV, cache, key, max_new, eos_id, pad_id, *, sampling, return_logits
):
    """Samples up to ``max_new`` tokens per row after a prefill that gave ``logits_BV``.

    ``eos_id < 0`` means no EOS. Row ``b`` may emit at most ``S - cache.lengths[b]`` tokens.
    """
    B, S = cache.batch_size, cache.capacity
    limit_B = jnp.minimum(max_new, S - cache.lengths)

    def emit(state, logits_BV):
        i = state.step
        live_B = ~state.done_B
        token_B = sample(logits_BV, jax.random.fold_in(key, i), sampling)
        token_B = jnp.where(live_B, token_B, pad_id)
        eos_B = live_B & (token_B == eos_id)
        count_B = state.count_B + live_B.astype(jnp.int32)
        logits_BSV = state.logits_BSV
        if return_logits:
            logits_BSV = jax.lax.dynamic_update_slice(logits_BSV, logits_BV[:, None], (0, i, 0))
        return state.replace(
            step=i + 1,
            token_B=token_B,
            tokens_BS=jax.lax.dynamic_update_slice(state.tokens_BS, token_B[:, None], (0, i)),
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
        logits_BSV=jnp.zeros((B, S, logits_BV.shape[-1]), jnp.float32) if return_logits else None,
        count_B=jnp.zeros((B,), jnp.int32),
        eos_B=jnp.zeros((B,), bool),
        done_B=limit_B <= 0,
    )
    state = emit(state, logits_BV)

    def body(state):
        logits_BTV, cache = step_fn(state.token_B[:, None], state.cache)
        # Stopped rows keep their length: their pad input only rewrites one unused slot.
        cache = cache.replace(lengths=jnp.where(state.done_B, state.cache.lengths, cache.lengths))
        return emit(state.replace(cache=cache), logits_BTV[:, 0])

    return while_in_phases(
        lambda s: (s.step < max_new) & ~jnp.all(s.done_B),
        body,
        state,
        lambda s: jnp.max(jnp.where(s.done_B, 0, s.cache.lengths)),
    )


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


def beam_loop(step_fn, logits_BV, cache, max_new, eos_id, pad_id, length_penalty, *, num_beams):
    """Beam search after a prefill that gave ``logits_BV``; scores are summed log-probs
    divided by ``length ** length_penalty`` (length = generated tokens, EOS included)."""
    B, S = cache.batch_size, cache.capacity
    W, V = num_beams, logits_BV.shape[-1]

    def norm(length):
        return length.astype(jnp.float32) ** length_penalty

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
        alive_lp_BW=first_lp_BW.astype(jnp.float32),
        best_BS=jnp.full((B, S), pad_id, jnp.int32),
        best_score_B=jnp.full((B,), -jnp.inf, jnp.float32),
        best_len_B=jnp.zeros((B,), jnp.int32),
    )
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    state = expand(state, jnp.broadcast_to(logp_BV[:, None], (B, W, V)))

    def cond(state):
        # An alive beam's score can only fall: stop once none can beat the best finished one.
        longest = jnp.where(length_penalty > 0, max_new, state.step)
        bound_B = jnp.max(state.alive_lp_BW, axis=1) / norm(longest)
        return (state.step < max_new) & ~jnp.all(bound_B <= state.best_score_B)

    def body(state):
        logits_BTV, cache = step_fn(state.token_BW.reshape(B * W, 1), state.cache)
        logp_BWV = jax.nn.log_softmax(logits_BTV[:, 0].astype(jnp.float32), axis=-1)
        return expand(state.replace(cache=cache), logp_BWV.reshape(B, W, V))

    state = while_in_phases(cond, body, state, lambda s: jnp.max(s.cache.lengths))
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


# ------------------------------------------------------------------------------------------
# Jitted steps for one model graph
# ------------------------------------------------------------------------------------------


class Decoder:
    """``prefill``, ``decode_step``, ``encode`` and the generation loops, each jitted once.

    Every function takes the parameter state first and donates the cache. ``traces`` counts
    how often each was traced (a trace is a compilation).
    """

    def __init__(self, graphdef, cfg: ModelConfig):
        if cfg.arch == "encoder":
            raise ValueError("ModelConfig.arch='encoder' has no causal decoder to generate with")
        self.graphdef, self.cfg = graphdef, cfg
        self.seq2seq = cfg.arch == "encoder_decoder"
        self.traces = collections.Counter()
        jit = functools.partial(jax.jit, donate_argnames="cache")
        self.prefill = jit(self._prefill)
        self.decode_step = jit(self._decode_step)
        self.encode = jit(self._encode)
        self.sample_loop = jit(self._sample_loop, static_argnames=("sampling", "return_logits"))
        # The beam loop widens the cache to B * num_beams rows, so nothing could be donated.
        self.beam_loop = jax.jit(self._beam_loop, static_argnames=("num_beams",))

    @classmethod
    def for_model(cls, model) -> tuple[Decoder, Any]:
        """The (shared) decoder of ``model``'s graph and the model's parameter state."""
        graphdef, params = nnx.split(model)
        return _decoder(graphdef, model.cfg), params

    def _merge(self, params):
        model = nnx.merge(self.graphdef, params)
        call = model.decode if self.seq2seq else model

        def step_fn(tokens_BT, cache):
            out = call(tokens_BT, cache=cache)
            return out.logits, out.cache

        return model, call, step_fn

    def _prefill(self, params, cache: KVCache, tokens_BT, lengths_B):
        """Appends each row's ``lengths_B[b]`` prompt tokens; logits at each row's last one."""
        self.traces["prefill"] += 1
        model, call, _ = self._merge(params)
        out = call(tokens_BT, cache=cache)
        # The head on each row's last real token only; XLA drops the unused [B, T, V] logits.
        h_B1D = jnp.take_along_axis(out.hidden, (lengths_B - 1)[:, None, None], axis=1)
        logits_BV = model.head(h_B1D, model.embed.tokens)[:, 0]
        return logits_BV, out.cache.replace(lengths=cache.lengths + lengths_B)

    def _decode_step(self, params, cache: KVCache, token_B):
        """Appends one token per row; returns the next-token logits ``[B, V]``."""
        self.traces["decode_step"] += 1
        logits_BTV, cache = self._merge(params)[2](token_B[:, None], cache)
        return logits_BTV[:, 0], cache

    def _encode(self, params, cache: KVCache, src_BS, src_valid_BS):
        """Encodes the source and stores every layer's cross-attention keys/values."""
        self.traces["encode"] += 1
        model = nnx.merge(self.graphdef, params)
        enc_BSD = model.encode(src_BS, src_valid_BS=src_valid_BS)
        return model.init_cross_cache(cache, enc_BSD, src_valid_BS)

    def _sample_loop(self, params, cache, logits_BV, key, max_new, eos_id, pad_id, **static):
        self.traces["sample_loop"] += 1
        step_fn = self._merge(params)[2]
        state = sample_loop(step_fn, logits_BV, cache, key, max_new, eos_id, pad_id, **static)
        return {
            "tokens_BS": state.tokens_BS,
            "logits_BSV": state.logits_BSV,
            "count_B": state.count_B,
            "eos_B": state.eos_B,
            "cache": state.cache,
        }

    def _beam_loop(self, params, cache, logits_BV, max_new, eos_id, pad_id, penalty, **static):
        self.traces["beam_loop"] += 1
        step_fn = self._merge(params)[2]
        return beam_loop(step_fn, logits_BV, cache, max_new, eos_id, pad_id, penalty, **static)


@functools.lru_cache(maxsize=16)
def _decoder(graphdef, cfg: ModelConfig) -> Decoder:
    return Decoder(graphdef, cfg)


# ------------------------------------------------------------------------------------------
# Host-side checks (before any computation)
# ------------------------------------------------------------------------------------------


def _rows(ids, lengths, pad_id, name):
    """A right-padded ``[B, P]`` int array and ``[B]`` lengths from an array or lists."""
    if isinstance(ids, list | tuple) and all(
        isinstance(r, list | tuple | np.ndarray | jax.Array) for r in ids
    ):
        rows = [np.asarray(r).reshape(-1) for r in ids]
        default_lengths = np.array([len(r) for r in rows], np.int64)
        P = max([len(r) for r in rows], default=0)
        out = np.full((len(rows), P), pad_id, np.int64)
        for b, r in enumerate(rows):
            if r.size and not np.issubdtype(r.dtype, np.integer):
                raise ValueError(f"{name}[{b}] must hold integer token ids, got dtype {r.dtype}")
            out[b, : len(r)] = r
    else:
        out = np.asarray(ids)
        if out.ndim != 2:
            raise ValueError(
                f"{name} must be 2-D [batch, length] (or a list of lists), got shape {out.shape}"
            )
        if not np.issubdtype(out.dtype, np.integer):
            raise ValueError(f"{name} must hold integer token ids, got dtype {out.dtype}")
        default_lengths = np.full((out.shape[0],), out.shape[1], np.int64)
    if out.shape[0] == 0:
        raise ValueError(f"{name} has no rows")
    lengths = default_lengths if lengths is None else np.asarray(lengths).astype(np.int64)
    if lengths.shape != (out.shape[0],):
        raise ValueError(f"{name} lengths must have shape [{out.shape[0]}], got {lengths.shape}")
    bad = np.flatnonzero((lengths < 0) | (lengths > out.shape[1]))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"row {b} of {name} has length {lengths[b]}, outside [0, {out.shape[1]}]")
    return out, lengths


def _check_ids(ids_BP, valid_BP, vocab_size, name):
    bad_BP = valid_BP & ((ids_BP < 0) | (ids_BP >= vocab_size))
    if bad_BP.any():
        b, t = (int(i) for i in np.argwhere(bad_BP)[0])
        raise ValueError(
            f"{name}[{b}, {t}] = {ids_BP[b, t]} is not a token id: ids must lie in "
            f"[0, vocab_size={vocab_size}) (pad positions past a row's length are not checked)"
        )


def _check_token(name, value, vocab_size, optional=False):
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name}={value!r} must be an int token id")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name}={value} is outside [0, vocab_size={vocab_size})")


def _check_count(max_new_tokens):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    return int(max_new_tokens)


def _capacity(cfg: ModelConfig, max_len):
    if max_len is None:
        return cfg.max_len
    if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 1:
        raise ValueError(f"max_len={max_len!r} must be a positive int (the cache capacity)")
    if max_len > cfg.max_len:
        raise ValueError(
            f"max_len={max_len} exceeds ModelConfig.max_len={cfg.max_len}: the model has no "
            "positions beyond it; pass max_len <= ModelConfig.max_len"
        )
    return int(max_len)


def _overflow_message(what, used, n, cap, cfg, max_len, stop_hint):
    """Names the numbers and the ways out of a sequence longer than the cache."""
    if max_len is None:
        bound, larger = f"ModelConfig.max_len={cfg.max_len}", ""
    else:
        bound = f"the cache capacity max_len={cap}"
        larger = "" if cap == cfg.max_len else f", raise max_len (up to {cfg.max_len})"
    head = f"{what} + max_new_tokens {n} = {used + n} exceeds {bound}"
    if used > cap:
        return f"{what} alone exceeds {bound}: shorten it{larger}"
    stop = ", or pass on_overflow='stop' to stop rows at capacity" if stop_hint else ""
    return f"{head}: shorten the input, lower max_new_tokens{larger}{stop}"


def _bucket(n, cap, smallest=16):
    return min(cap, max(smallest, 1 << max(int(n) - 1, 0).bit_length()))


def _padded(ids_BP, lengths_B, width, pad_id):
    out = np.full((ids_BP.shape[0], width), pad_id, np.int32)
    for b, n in enumerate(lengths_B):
        out[b, :n] = ids_BP[b, :n]
    return out


def _result(prefix_rows, out, n, pad_id, logits=None, scores=None):
    """Host arrays from a loop's output (tokens [B, S] buffer, counts, EOS flags)."""
    buf = np.asarray(out["tokens_BS"])
    B, S = buf.shape
    m = min(n, S)
    tokens = np.full((B, n), pad_id, np.int32)
    tokens[:, :m] = buf[:, :m]
    count = np.minimum(np.asarray(out["count_B"]).astype(np.int64), n)
    eos = np.asarray(out["eos_B"]) & (count > 0)
    reasons = [
        "eos" if eos[b] else "max_new_tokens" if count[b] >= n else "capacity" for b in range(B)
    ]
    sequences = [
        np.concatenate([np.asarray(prefix_rows[b], np.int32), tokens[b, : count[b]]])
        for b in range(B)
    ]
    if logits is not None:
        full = np.zeros((B, n, logits.shape[-1]), np.float32)
        full[:, :m] = np.asarray(logits)[:, :m]
        logits = full
    return GenerationResult(tokens, sequences, count, reasons, logits, scores)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------


def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    *,
    prompt_lengths=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
    pad_id: int = 0,
    max_len: int | None = None,
    on_overflow: str = "raise",
    return_logits: bool = False,
) -> GenerationResult:
    """Continues each prompt of a decoder-only model by up to ``max_new_tokens`` tokens.

    ``prompt_ids`` is a right-padded ``[B, P]`` int array or a list of lists;
    ``prompt_lengths`` defaults to ``P`` (or the list lengths). ``max_len`` is the cache
    capacity (default ``ModelConfig.max_len``). ``on_overflow``: ``"raise"`` (a ValueError
    before any computation) or ``"stop"`` (rows stop with reason ``"capacity"``).
    """
    cfg = model.cfg
    if cfg.arch != "decoder":
        raise ValueError(
            f"generate is for decoder-only models, got ModelConfig.arch={cfg.arch!r}; "
            "use generate_seq2seq for encoder-decoder models"
        )
    if not cfg.causal:
        raise ValueError("ModelConfig.causal=False (an ablation) cannot generate: use causal")
    if on_overflow not in ("raise", "stop"):
        raise ValueError(f"on_overflow={on_overflow!r} must be 'raise' or 'stop'")
    sampling = SamplingConfig(temperature, top_k, top_p, min_p)
    n = _check_count(max_new_tokens)
    ids_BP, lengths_B = _rows(prompt_ids, prompt_lengths, pad_id, "prompt_ids")
    empty = np.flatnonzero(lengths_B == 0)
    if empty.size:
        raise ValueError(
            f"prompt row {int(empty[0])} is empty (length 0): a decoder-only model needs at "
            "least one prompt token (e.g. a BOS id) to condition on"
        )
    valid_BP = np.arange(ids_BP.shape[1])[None, :] < lengths_B[:, None]
    _check_ids(ids_BP, valid_BP, cfg.vocab_size, "prompt_ids")
    _check_token("eos_id", eos_id, cfg.vocab_size, optional=True)
    _check_token("pad_id", pad_id, cfg.vocab_size)
    cap = _capacity(cfg, max_len)
    longest = int(lengths_B.max())
    if longest > cap or (longest + n > cap and on_overflow == "raise"):
        what = f"prompt length {longest} (row {int(lengths_B.argmax())})"
        raise ValueError(_overflow_message(what, longest, n, cap, cfg, max_len, True))

    decoder, params = Decoder.for_model(model)
    B = ids_BP.shape[0]
    tokens_BT = _padded(ids_BP, lengths_B, _bucket(longest, cap), pad_id)
    cache = kv_cache.init_cache(cfg, B, cap)
    logits_BV, cache = decoder.prefill(
        params, cache, jnp.asarray(tokens_BT), jnp.asarray(lengths_B, jnp.int32)
    )
    out = decoder.sample_loop(
        params,
        cache,
        logits_BV,
        jax.random.key(seed),
        np.int32(n),
        np.int32(-1 if eos_id is None else eos_id),
        np.int32(pad_id),
        sampling=sampling,
        return_logits=return_logits,
    )
    prompts = [ids_BP[b, : lengths_B[b]] for b in range(B)]
    return _result(prompts, out, n, pad_id, logits=out["logits_BSV"])


def _seq2seq_start(
    model, source_ids, source_valid, max_new_tokens, start_id, eos_id, pad_id, max_len
):
    """Checks, then encodes: the decoder, params, cache (cross K/V in) and first logits."""
    cfg = model.cfg
    if cfg.arch != "encoder_decoder":
        raise ValueError(
            f"generate_seq2seq / beam_search are for encoder-decoder models, got "
            f"ModelConfig.arch={cfg.arch!r}; use generate for decoder-only models"
        )
    n = _check_count(max_new_tokens)
    src_BS, src_len_B = _rows(source_ids, None, pad_id, "source_ids")
    if source_valid is None:
        valid_BS = np.arange(src_BS.shape[1])[None, :] < src_len_B[:, None]
    else:
        valid_BS = np.asarray(source_valid).astype(bool)
        if valid_BS.shape != src_BS.shape:
            raise ValueError(
                f"source_valid has shape {valid_BS.shape} but source_ids {src_BS.shape}: they "
                "must match"
            )
    _check_ids(src_BS, valid_BS, cfg.vocab_size, "source_ids")
    _check_token("start_id", start_id, cfg.vocab_size)
    _check_token("pad_id", pad_id, cfg.vocab_size)
    _check_token("eos_id", eos_id, cfg.vocab_size, optional=True)
    S_src = src_BS.shape[1]
    if S_src > cfg.max_len:
        raise ValueError(
            f"source length {S_src} exceeds ModelConfig.max_len={cfg.max_len}: the encoder has "
            "no positions beyond it; truncate the source"
        )
    cap = _capacity(cfg, max_len)
    if 1 + n > cap:
        raise ValueError(_overflow_message("start token 1", 1, n, cap, cfg, max_len, False))

    decoder, params = Decoder.for_model(model)
    B = src_BS.shape[0]
    width = _bucket(S_src, cfg.max_len)
    src = np.full((B, width), pad_id, np.int32)
    src[:, :S_src] = np.where(valid_BS, src_BS, pad_id)
    valid = np.zeros((B, width), bool)
    valid[:, :S_src] = valid_BS
    cache = kv_cache.init_cache(cfg, B, cap)
    cache = decoder.encode(params, cache, jnp.asarray(src), jnp.asarray(valid))
    start_B1 = jnp.full((B, 1), start_id, jnp.int32)
    logits_BV, cache = decoder.prefill(params, cache, start_B1, jnp.ones((B,), jnp.int32))
    return decoder, params, cache, logits_BV, n, [np.array([start_id], np.int32)] * B


def generate_seq2seq(
    model,
    source_ids,
    max_new_tokens: int,
    *,
    source_valid=None,
    start_id: int,
    eos_id: int | None = None,
    pad_id: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    max_len: int | None = None,
    return_logits: bool = False,
) -> GenerationResult:
    """Encodes each source once and decodes up to ``max_new_tokens`` target tokens.

    The cross-attention keys/values are computed once into the cache. ``source_ids`` is a
    right-padded ``[B, S]`` int array or a list of lists; ``source_valid`` ``[B, S]`` (bool)
    defaults to all-True for arrays and to the row lengths for lists. ``num_beams > 1``
    runs ``beam_search``. ``.tokens`` excludes the start token, ``.sequences`` include it.
    """
    sampling = SamplingConfig(temperature, top_k, top_p, min_p)
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams={num_beams!r} must be an int >= 1")
    if num_beams > 1:
        if not sampling.greedy:
            raise ValueError("num_beams > 1 is deterministic beam search: leave temperature 0")
        if return_logits:
            raise ValueError("return_logits is only available with num_beams=1")
        return beam_search(
            model,
            source_ids,
            max_new_tokens,
            num_beams=num_beams,
            source_valid=source_valid,
            start_id=start_id,
            eos_id=eos_id,
            pad_id=pad_id,
            length_penalty=length_penalty,
            max_len=max_len,
        )
    decoder, params, cache, logits_BV, n, starts = _seq2seq_start(
        model, source_ids, source_valid, max_new_tokens, start_id, eos_id, pad_id, max_len
    )
    out = decoder.sample_loop(
        params,
        cache,
        logits_BV,
        jax.random.key(seed),
        np.int32(n),
        np.int32(-1 if eos_id is None else eos_id),
        np.int32(pad_id),
        sampling=sampling,
        return_logits=return_logits,
    )
    return _result(starts, out, n, pad_id, logits=out["logits_BSV"])


def beam_search(
    model,
    source_ids,
    max_new_tokens: int,
    *,
    num_beams: int = 4,
    source_valid=None,
    start_id: int,
    eos_id: int | None = None,
    pad_id: int = 0,
    length_penalty: float = 1.0,
    max_len: int | None = None,
) -> GenerationResult:
    """Beam search for an encoder-decoder model; the best hypothesis of each row.

    A hypothesis scores its summed log-probabilities divided by ``length ** length_penalty``
    (length = generated tokens, EOS included); ``.scores`` holds the winners' scores. A row
    stops once no alive beam can beat its best EOS-ended hypothesis. ``num_beams=1`` is
    greedy decoding.
    """
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams={num_beams!r} must be an int >= 1")
    if 2 * num_beams > model.cfg.vocab_size:
        raise ValueError(f"num_beams={num_beams} needs vocab_size >= {2 * num_beams}")
    decoder, params, cache, logits_BV, n, starts = _seq2seq_start(
        model, source_ids, source_valid, max_new_tokens, start_id, eos_id, pad_id, max_len
    )
    out = decoder.beam_loop(
        params,
        cache,
        logits_BV,
        np.int32(n),
        np.int32(-1 if eos_id is None else eos_id),
        np.int32(pad_id),
        np.float32(length_penalty),
        num_beams=num_beams,
    )
    return _result(starts, out, n, pad_id, scores=np.asarray(out["score_B"]))
