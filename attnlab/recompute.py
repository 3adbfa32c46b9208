"""Generation by full recomputation: no KV cache, the whole sequence re-run at every step.

The cached decoder (``attnlab.decode``) is the fast path and is exact only for causal models.
This loop is the slow, model-agnostic reference: at each step it runs the model over a fixed
``[B, P + N]`` buffer with the keys past the current length masked, so it also serves models
trained without their causal mask (the causal-mask ablation), which still see only the tokens
generated so far when they generate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.data.tokenizers import validate_ids
from attnlab.sampling import SamplingConfig, sample


def generate_by_recompute(
    model,
    prompt_ids,
    max_new_tokens: int,
    *,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seed=0,
) -> np.ndarray:
    """``[B, N]`` new tokens for equal-length prompts ``[B, P]``, re-running the full model."""
    cfg = model.cfg
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt_ids must be a non-empty [B, P] array, got shape {prompt.shape}")
    validate_ids(prompt, cfg.vocab_size, name="prompt ids")
    B, P = prompt.shape
    total = P + int(max_new_tokens)
    if total > cfg.max_len:
        raise ValueError(
            f"prompt length {P} + max_new_tokens {max_new_tokens} = {total} exceeds "
            f"ModelConfig.max_len={cfg.max_len}; shorten the prompt or generate fewer tokens"
        )
    sampling = SamplingConfig(
        temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), min_p=float(min_p)
    )
    graphdef, params = nnx.split(model)
    buffer = jnp.zeros((B, total), jnp.int32).at[:, :P].set(jnp.asarray(prompt, jnp.int32))

    @jax.jit
    def run(params, buffer, key):
        m = nnx.merge(graphdef, params)

        def step(i, buf):
            length = P + i
            valid_BT = jnp.broadcast_to(jnp.arange(total)[None, :] < length, (B, total))
            logits_BTV = m(buf, valid_BT=valid_BT).logits
            logits_BV = jax.lax.dynamic_index_in_dim(logits_BTV, length - 1, 1, keepdims=False)
            token_B = sample(logits_BV, jax.random.fold_in(key, i), sampling)
            return jax.lax.dynamic_update_index_in_dim(buf, token_B.astype(jnp.int32), length, 1)

        return jax.lax.fori_loop(0, total - P, step, buffer)

    out = run(params, buffer, jax.random.key(seed))
    return np.asarray(out[:, P:])
