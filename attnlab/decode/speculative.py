"""Greedy speculative decoding with a model's own multi-token-prediction modules.

Each step drafts ``K`` tokens with the MTP modules (``ModelConfig.mtp_depth``, DeepSeek-V3:
module ``k`` reads the previous depth's hidden state and the embedding of the token ``k``
ahead, so depth 1 drafts the token after the last known one, depth 2 the one after that),
then verifies them with the main model in one cached forward pass over the last known token
and the ``K`` drafts. The longest prefix of drafts that equal the main model's greedy
choices is accepted, plus the main model's own next token, so every step adds 1 to ``K + 1``
tokens and the output is the greedy decoding's (up to float rounding between a one-token
and a ``K + 1``-token pass, which can only matter at an exact tie of two logits).

Rows move in lockstep: a step accepts the fewest drafts any row accepts. The cache is a
linear one (drafts that fail are dropped by moving each row's length back); mixers with
recurrent state cannot be rolled back and are refused. The MTP modules see the whole
token buffer each step (no cache of their own): drafting costs ``K`` blocks over the
buffer, which suits the short generations of a research model.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.errors import DecodeError
from attnlab.kv_cache import cache_entries, init_cache
from attnlab.nn.mtp import shifted


@dataclasses.dataclass(frozen=True)
class SpeculativeResult:
    """What ``speculative_generate`` returns: the tokens and how many each pass added."""

    tokens: np.ndarray  # [B, max_new_tokens] the generated ids
    steps: int  # main-model verification passes
    accepted: int  # tokens added over those steps (>= max_new_tokens)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verification pass adds on average (1 without any accepted draft)."""
        return self.accepted / max(self.steps, 1)


def _check(cfg, P, n, depth):
    if not getattr(cfg, "mtp_depth", 0):
        raise DecodeError("speculative decoding drafts with the MTP modules: model.mtp_depth=0")
    if not 1 <= depth <= cfg.mtp_depth:
        raise DecodeError(f"depth={depth} is invalid: use 1..model.mtp_depth={cfg.mtp_depth}")
    if any(e.slot_axis is None for e in cache_entries(cfg).values()):
        raise DecodeError(
            "speculative decoding rolls the cache back, which a recurrent state cannot: "
            "use a model whose mixers keep per-token keys and values"
        )
    if cfg.sliding_window is not None:
        raise DecodeError("speculative decoding needs a linear cache: set sliding_window=None")
    need = P + n + depth + 1
    if need > cfg.max_len:
        raise DecodeError(
            f"prompt ({P}) + max_new_tokens ({n}) + depth + 1 = {need} positions exceed "
            f"model.max_len={cfg.max_len}: shorten them"
        )


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _speculate(graphdef, params, prompt_BP, n_new, depth):
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    B, P = prompt_BP.shape
    L = P + n_new + depth + 1
    out = model(prompt_BP, cache=init_cache(cfg, B, L, on_overflow="flag"))  # fits: _check
    tokens_BL = jnp.zeros((B, L), jnp.int32).at[:, :P].set(prompt_BP)
    tokens_BL = tokens_BL.at[:, P].set(jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32))
    hidden_BLD = jnp.zeros((B, L, cfg.d_model), out.hidden.dtype).at[:, :P].set(out.hidden)

    def draft(tokens_BL, hidden_BLD, n):
        """``[B, depth]`` drafts after the ``n`` known tokens (the last at ``n - 1``)."""
        h_BLD, seq_BL, drafts = hidden_BLD, tokens_BL, []
        positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None, :], (B, L))
        mask, bias, _, _ = model.decoder._self_attention(L, positions, None, None, None, None)
        from attnlab.contracts.mixer import MixerCall

        call = MixerCall(positions_BT=positions, mask=mask, bias=bias)
        for k, module in enumerate(model.mtp.depths[:depth], start=1):
            e_BLD = model.embed(shifted(seq_BL, k)).astype(h_BLD.dtype)
            h_BLD = module(h_BLD, e_BLD, call)
            h_BD = jax.lax.dynamic_index_in_dim(h_BLD, n - 2, axis=1, keepdims=True)
            logits = model.head(module.out_norm(h_BD), model.embed.tokens)[:, 0]
            d_B = jnp.argmax(logits, -1).astype(jnp.int32)
            seq_BL = jax.lax.dynamic_update_slice(seq_BL, d_B[:, None], (0, n - 1 + k))
            drafts.append(d_B)
        return jnp.stack(drafts, axis=1)

    def body(state):
        tokens_BL, hidden_BLD, cache, n, steps, added = state
        drafts_BK = draft(tokens_BL, hidden_BLD, n)
        last_B1 = jax.lax.dynamic_slice_in_dim(tokens_BL, n - 1, 1, axis=1)
        inputs = jnp.concatenate([last_B1, drafts_BK], axis=1)  # [B, K + 1]
        out = model(inputs, cache=cache.replace(lengths=jnp.full((B,), n - 1, jnp.int32)))
        greedy_BK1 = jnp.argmax(out.logits, -1).astype(jnp.int32)
        agree_BK = drafts_BK == greedy_BK1[:, :depth]
        a = jnp.min(jnp.sum(jnp.cumprod(agree_BK.astype(jnp.int32), axis=1), axis=1))
        tokens_BL = jax.lax.dynamic_update_slice(tokens_BL, greedy_BK1, (0, n))
        hidden_BLD = jax.lax.dynamic_update_slice(hidden_BLD, out.hidden, (0, n - 1, 0))
        return tokens_BL, hidden_BLD, out.cache, n + a + 1, steps + 1, added + a + 1

    n0 = jnp.int32(P + 1)
    state = (tokens_BL, hidden_BLD, out.cache, n0, jnp.int32(0), jnp.int32(1))
    tokens_BL, _, _, _, steps, added = jax.lax.while_loop(lambda s: s[3] < P + n_new, body, state)
    return tokens_BL[:, P : P + n_new], steps, added


def speculative_generate(model, prompt_ids, max_new_tokens: int, *, depth: int | None = None):
    """Greedy continuation of ``prompt_ids`` (``[B, P]``, no padding) by ``max_new_tokens``
    tokens, drafted by the first ``depth`` MTP modules (default: all) and verified by the
    model; a ``SpeculativeResult`` with the tokens per verification pass."""
    cfg = model.cfg
    prompt_BP = np.asarray(prompt_ids, np.int32)
    if prompt_BP.ndim != 2 or prompt_BP.shape[1] < 1:
        raise DecodeError(f"prompt_ids must be [B, P] with P >= 1, got shape {prompt_BP.shape}")
    depth = int(cfg.mtp_depth if depth is None else depth)
    n = int(max_new_tokens)
    _check(cfg, prompt_BP.shape[1], n, depth)
    graphdef, params = nnx.split(model)
    tokens, steps, added = _speculate(graphdef, params, jnp.asarray(prompt_BP), n, depth)
    # The prefill's token counts as a step of its own (no draft).
    return SpeculativeResult(np.asarray(tokens), int(steps) + 1, int(added))
