"""Generation by full recomputation: no KV cache, the whole sequence re-run at every step.

The cached decoder (``attnlab.decode.compiled``) is the fast path and is exact only for
causal models. This is the slow, model-agnostic reference: the "cache" the generation loop
carries is a ``TokenBuffer`` (``[B, W]`` ids and each row's length), and a step writes the
new token, re-runs the model over the whole buffer with the keys past each row's length
masked, and reads the logits at the row's last token. It therefore also serves decoders
trained without their causal mask (the causal-mask ablation), which see only the tokens
generated so far when they generate. Encoder-decoder models re-encode the source each step.

``recompute_loop`` is one module-level ``jax.jit`` with the graph static and the parameters
traced: it compiles once per shape, for every model of a graph.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from attnlab.decode.loops import sample_loop
from attnlab.decode.sampling import SamplingConfig
from attnlab.ops.precision import upcast


@struct.dataclass
class TokenBuffer:
    """Token ids ``[B, W]`` and each row's length: the state recomputation carries."""

    ids_BW: jax.Array
    lengths: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        return self.ids_BW.shape[1]

    @property
    def batch_size(self) -> int:
        return self.ids_BW.shape[0]


def last_logits_fn(model, src_BS=None, src_valid_BS=None):
    """``(ids_BW, lengths_B) -> logits_BV`` at each row's last token, by a full pass."""

    def last_logits(ids_BW, lengths_B):
        W = ids_BW.shape[1]
        if src_BS is None:
            valid_BW = jnp.arange(W)[None, :] < lengths_B[:, None]
            h_BWD = model(ids_BW, valid_BT=valid_BW).hidden
        else:  # the decoder is causal: what lies past a position cannot matter
            h_BWD = model(src_BS, ids_BW, src_valid_BS=src_valid_BS).hidden
        h_B1D = jnp.take_along_axis(h_BWD, (lengths_B - 1)[:, None, None], axis=1)
        return upcast(model.head(h_B1D, model.embed.tokens)[:, 0])

    return last_logits


def step_fn(last_logits):
    """The loop's step ``(tokens_B1, buffer) -> (logits_B1V, buffer)``: write, then re-run."""

    def step(tokens_B1, buf: TokenBuffer):
        rows_B = jnp.arange(buf.batch_size)
        ids_BW = buf.ids_BW.at[rows_B, buf.lengths].set(tokens_B1[:, 0], mode="drop")
        lengths_B = buf.lengths + 1
        logits_BV = last_logits(ids_BW, jnp.minimum(lengths_B, buf.capacity))
        return logits_BV[:, None], TokenBuffer(ids_BW, lengths_B)

    return step


@functools.partial(jax.jit, static_argnums=0, static_argnames="return_logits")
def recompute_loop(
    graphdef,
    params,
    ids_BW,
    lengths_B,
    src_BS,
    src_valid_BS,
    key,
    max_new,
    eos_id,
    pad_id,
    sampling: SamplingConfig,
    *,
    return_logits: bool,
) -> dict:
    """Up to ``max_new`` new tokens after each row's ``lengths_B[b]`` ids of ``ids_BW``;
    the output of ``loops.sample_loop``. ``src_BS`` is None for decoder-only models."""
    model = nnx.merge(graphdef, params)
    last_logits = last_logits_fn(model, src_BS, src_valid_BS)
    return sample_loop(
        step_fn(last_logits),
        last_logits(ids_BW, lengths_B),
        TokenBuffer(ids_BW, lengths_B),
        key,
        max_new,
        eos_id,
        pad_id,
        sampling,
        return_logits=return_logits,
        phased=False,
    )
