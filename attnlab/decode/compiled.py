"""``Decoder``: the jitted prefill, decode step, encoder and loops of one model graph.

Every function takes the parameter state first and merges it inside (``nnx.merge``), so
new weights never recompile; one ``Decoder`` serves every model of a graph.

Chunked prefill: a prompt longer than ``PREFILL_CHUNK`` tokens (or than ``chunk``, when
given) runs through the cache ``C`` tokens at a time in a ``lax.scan``, each chunk attending
over the cache so far and itself: scores are ``[B, N, C, S]`` (``[B, N, C, W + C]`` over a
ring buffer), never ``[B, N, T, T]``, so a long prompt's temporaries follow C, not T.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.config.architectures import architecture
from attnlab.decode.loops import beam_loop, sample_loop
from attnlab.errors import DecodeError
from attnlab.kv_cache import KVCache

PREFILL_CHUNK = 1024  # prompts longer than this are prefilled in chunks of this many tokens


def chunk_size(T: int, chunk: int | None) -> int:
    """The chunk a ``T``-token prefill runs in: ``chunk``, or by default all ``T`` tokens at
    once up to ``PREFILL_CHUNK`` tokens and chunks of ``PREFILL_CHUNK`` above."""
    if chunk is None:
        return min(T, PREFILL_CHUNK)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise DecodeError(f"prefill_chunk={chunk!r} must be an int >= 1 (or None: the default)")
    return min(T, chunk)


class Decoder:
    """``prefill``, ``decode_step``, ``encode`` and the generation loops, each jitted once.

    The cache is donated where nothing else holds it. Sampling settings, token budgets and
    special ids are traced; only shapes, ``return_logits`` and ``num_beams`` are static.
    ``traces`` counts how often each function was traced (a trace is a compilation).
    """

    def __init__(self, graphdef, cfg: ModelConfig):
        if not architecture(cfg).generates:
            raise DecodeError(
                f"ModelConfig.arch={cfg.arch!r} has no causal decoder to generate with"
            )
        self.graphdef, self.cfg = graphdef, cfg
        self.seq2seq = architecture(cfg).seq2seq
        self.traces = collections.Counter()
        self.unstack_layers = cfg.decode_unstacked
        jit = functools.partial(jax.jit, donate_argnames="cache")
        self.prefill = jit(self.prefill_fn, static_argnames="chunk")
        self.decode_step = jit(self.decode_step_fn)
        self.encode = jit(self.encode_fn)
        self.sample_loop = jit(self.sample_loop_fn, static_argnames="return_logits")
        # The beam loop widens the cache to B * num_beams rows, so nothing could be donated.
        self.beam_loop = jax.jit(self.beam_loop_fn, static_argnames="num_beams")

    @classmethod
    def for_graph(cls, graphdef, cfg: ModelConfig) -> Decoder:
        """The decoder shared by every model of ``graphdef``."""
        return _shared(graphdef, cfg)

    @classmethod
    def for_model(cls, model) -> tuple[Decoder, Any]:
        """The (shared) decoder of ``model``'s graph and the model's parameter state."""
        graphdef, params = nnx.split(model)
        return cls.for_graph(graphdef, model.cfg), params

    def step_fn(self, params, *, unstack=False):
        """The model as a loop sees it: ``(tokens_BT, cache) -> (logits_BTV, cache)``.

        ``unstack``: slice the decoder's stacked layers into separate blocks here, once,
        outside the loop that calls ``step`` (``Stack.unstack``).
        """
        model = nnx.merge(self.graphdef, params)
        if unstack:
            model.decoder.unstack()
        call = model.decode if self.seq2seq else model

        def step(tokens_BT, cache):
            out = call(tokens_BT, cache=cache)
            return out.logits, out.cache

        return step

    # The unjitted bodies (public so tests can run them inside their own programs).
    def prefill_fn(self, params, cache: KVCache, tokens_BT, lengths_B, *, chunk=None):
        """Appends each row's ``lengths_B[b]`` prompt tokens; logits at each row's last one.

        ``chunk`` (static): run the prompt in chunks of that many tokens (``chunk_size``
        gives the default). Only real tokens are stored, so a ring buffer keeps each row's
        last prompt tokens, not its padding.
        """
        self.traces["prefill"] += 1
        model = nnx.merge(self.graphdef, params)
        call = model.decode if self.seq2seq else model
        B, T = tokens_BT.shape
        C = chunk_size(T, chunk)
        n = -(-T // C)
        start_B = cache.lengths
        top = self.cfg.max_len - 1

        def run(cache, i, tokens_BC):
            """One chunk; the hidden state at each row's last prompt token if it lies here."""
            t_1C = i * C + jnp.arange(C, dtype=jnp.int32)[None, :]
            # Padding past a row's prompt gets a position the model has (it is not stored).
            positions_BC = jnp.minimum(start_B[:, None] + t_1C, top)
            out = call(
                tokens_BC, positions_BT=positions_BC, valid_BT=t_1C < lengths_B[:, None],
                cache=cache,
            )  # fmt: skip
            at_B11 = jnp.clip(lengths_B - 1 - i * C, 0, C - 1)[:, None, None]
            return out.cache, jnp.take_along_axis(out.hidden, at_B11, axis=1)[:, 0]

        if n == 1:
            cache, h_BD = run(cache, 0, tokens_BT)
        else:
            pad = ((0, 0), (0, n * C - T))
            tokens_BT = jnp.pad(tokens_BT, pad, constant_values=self.cfg.pad_id)
            tokens_IBC = jnp.swapaxes(tokens_BT.reshape(B, n, C), 0, 1)
            cache, h_IBD = jax.lax.scan(
                lambda cache, xs: run(cache, *xs),
                cache,
                (jnp.arange(n, dtype=jnp.int32), tokens_IBC),
            )
            h_BD = h_IBD[(lengths_B - 1) // C, jnp.arange(B)]  # the chunk of the last token
        # The head on each row's last real token only: no [B, T, V] logits.
        logits_BV = model.head(h_BD[:, None], model.embed.tokens)[:, 0]
        return logits_BV, cache.replace(lengths=start_B + lengths_B)

    def decode_step_fn(self, params, cache: KVCache, token_B):
        """Appends one token per row; returns the next-token logits ``[B, V]``."""
        self.traces["decode_step"] += 1
        logits_BTV, cache = self.step_fn(params)(token_B[:, None], cache)
        return logits_BTV[:, 0], cache

    def encode_fn(self, params, cache: KVCache, src_BS, src_valid_BS):
        """Encodes the source and stores every layer's cross-attention keys/values."""
        self.traces["encode"] += 1
        model = nnx.merge(self.graphdef, params)
        enc_BSD = model.encode(src_BS, src_valid_BS=src_valid_BS)
        return model.init_cross_cache(cache, enc_BSD, src_valid_BS)

    def sample_loop_fn(
        self, params, cache, logits_BV, key, max_new, eos_id, pad_id, sampling, *, return_logits
    ):
        self.traces["sample_loop"] += 1
        return sample_loop(
            self.step_fn(params, unstack=self.unstack_layers),
            logits_BV,
            cache,
            key,
            max_new,
            eos_id,
            pad_id,
            sampling,
            return_logits=return_logits,
            split=self.unstack_layers,
        )

    def beam_loop_fn(
        self, params, cache, logits_BV, max_new, eos_id, pad_id, penalty, *, num_beams
    ):
        self.traces["beam_loop"] += 1
        step = self.step_fn(params, unstack=self.unstack_layers)
        return beam_loop(
            step, logits_BV, cache, max_new, eos_id, pad_id, penalty,
            num_beams=num_beams, split=self.unstack_layers,
        )  # fmt: skip


def unstacked(model, *, out_in: bool = False):
    """``model`` with its decoder's layers as separate blocks, for a model that will only
    generate (``attnlab sample``, a notebook sampling many times); ``model`` is left as is.

    Where the config decodes over separate blocks (``ModelConfig.decode_unstacked``, the
    default up to 12 layers), every ``generate`` call otherwise slices each layer's weights
    out of the stacked parameters twice (the scanned prefill and the loop: on CPU, copies
    of every weight); here that happens once. The loop's copy is the costly one: it writes
    ~340 MB of fresh memory per call for GPT-2 small (~90k minor page faults, 0.15-0.19 s
    of kernel time) while the tokens after it cost the same either way;
    ``benchmarks/decode.py`` reports the faults per call. Other models
    are returned as they are. The result's parameters no longer have the stacked layout,
    so it is not for training or for saving checkpoints.

    ``out_in=True`` also stores softmax attention's projections and the dense FFN's
    weights with their output axes first (``ops.Transposed``), for decoding one row at a
    time: XLA:CPU's matrix-vector products read a weight faster that way (GPT-2 small's
    batch-1 loop 8-10% faster a token, ``benchmarks/decode_layouts.py``), while from 8 rows
    its matrix products are slower (``benchmarks/matvec.py``).
    """
    if not architecture(model.cfg).generates or not model.cfg.decode_unstacked:
        return model
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)  # new modules over the same arrays
    copy.decoder.unstack()
    if out_in:
        _store_out_in(copy.decoder)
    return copy


def _store_out_in(decoder):
    """Stores the weights ``unstacked(out_in=True)`` transposes: softmax attention's and the
    dense FFN's, by their modules' own classes (a variant keeps its layout)."""
    from attnlab.nn.layers import FeedForward
    from attnlab.nn.mixers.mha import Attention
    from attnlab.ops.linear import Transposed

    input_axes = {  # parameter -> how many of its leading axes are the input's
        Attention: {"q_DNH": 1, "k_DKH": 1, "v_DKH": 1, "o_NHD": 2},
        FeedForward: {"w_in_DF": 1, "w_gate_DF": 1, "w_out_FD": 1},
    }
    for _, module in nnx.iter_graph(decoder):
        for name, n_in in input_axes.get(type(module), {}).items():
            param = getattr(module, name, None)
            if param is not None:
                param.set_value(Transposed.of(param.get_value(), n_in))


@functools.lru_cache(maxsize=16)
def _shared(graphdef, cfg: ModelConfig) -> Decoder:
    return Decoder(graphdef, cfg)
