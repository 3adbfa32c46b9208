"""The three architectures, all built from one ``ModelConfig``.

* ``DecoderLM``: GPT-style decoder-only language model (causal self-attention).
* ``EncoderMLM``: BERT-style encoder with a masked-language-model head.
* ``EncoderDecoder``: the 2017 Transformer (encoder; decoder with masked self-attention and
  cross-attention).

Each returns a ``ModelOutput`` pytree. Decoders take an optional ``KVCache`` and return the
updated one; nothing is stored on the module between calls. ``build_model``, ``init_params``
and ``count_params`` live in ``attnlab.nn.build`` (and still import from here).

Token ids are checked where they enter (``checked_ids``), always on: concrete ids outside
``[0, vocab_size)`` raise a ``DecodeError`` naming the id and its position; under ``jit``,
where values cannot raise, such ids embed as NaN, so the logits are NaN and the training
loop's divergence check stops the run (a gather would otherwise clamp or wrap silently).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from attnlab import _moved, ops
from attnlab.config import ModelConfig
from attnlab.devices.sharding import constrain
from attnlab.errors import DecodeError
from attnlab.kv_cache import KVCache, check_capacity, raise_on_overflow
from attnlab.nn import parametrization, probe
from attnlab.nn.build import build_model, count_params, init_params  # noqa: F401 (their old home)
from attnlab.nn.layers import Embed, Norm, normal
from attnlab.nn.mtp import MTP
from attnlab.nn.registry import MODEL_CLASSES
from attnlab.nn.stack import Stack, check_positions
from attnlab.ops.linear import add_bias, dense, fold
from attnlab.ops.precision import upcast, wide


@struct.dataclass
class ModelOutput:
    logits: jax.Array  # [B, T, V] float32 (float64 for a float64 model)
    cache: KVCache | None = None
    weights: tuple | None = None  # per layer: {"self": [B,N,T,S], "cross": ...}
    hidden: jax.Array | None = None  # [B, T, D] last hidden state
    # What the FFN variant reports (attnlab.contracts.ffn), per layer; "loss" summed over the layers
    # joins the training objective. None for the plain FFN.
    aux: dict | None = None
    # Named per-layer statistics asked for with ``collect`` (attnlab.nn.segments): e.g.
    # {"attention": {"max_logit": [L], ...}, "residual": {...}}; None when none were.
    stats: dict | None = None


def _default_positions(B, T, cfg: ModelConfig | None = None):
    """``0..T-1`` in each row; with ``cfg`` an absolute position table (learned,
    sinusoidal) shorter than ``T`` raises here, where ``T`` is known even under ``jit``."""
    if cfg is not None and cfg.position in ("learned", "sinusoidal"):
        check_positions(np.arange(T, dtype=np.int32)[None, :], cfg)
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))


def _run_decoder(stack, x_BTD, positions_BT, cache, *, valid_BS=None, **kw):
    """Runs a causal stack over new tokens, after what ``cache`` holds when one is given.

    New tokens sit at ``cache.lengths + t`` (or ``0..T-1`` without a cache). With a cache,
    ``valid_BS`` (right-padded) marks each row's real new tokens: lengths advance by their
    number, and a ring buffer stores only them (padding would overwrite real tokens).
    Returns ``(x_BTD, new_cache, weights, aux, stats)``. A write past a linear cache's
    capacity raises in an eager call; under ``jit`` it sets the returned cache's
    ``overflow`` and, as the cache's ``on_overflow`` chooses, raises when the program runs.
    """
    B, T, _ = x_BTD.shape
    if cache is not None and not isinstance(valid_BS, jax.core.Tracer):
        check_capacity(cache, T if valid_BS is None else np.sum(np.asarray(valid_BS), axis=1))
    if positions_BT is None:
        positions_BT = (
            _default_positions(B, T, stack.cfg)
            if cache is None
            else cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        )
    x_BTD, new_cache, *rest = stack(
        x_BTD, positions_BT=positions_BT, valid_BS=valid_BS, cache=cache, **kw
    )
    if cache is not None:
        new_cache = raise_on_overflow(new_cache, cache.lengths)
    return (x_BTD, new_cache, *rest)


class _LMHead(nnx.Module):
    """Tied or untied output projection with optional logit bias and hidden scaling (times
    muP's read-out multiplier, ``attnlab.nn.parametrization``)."""

    parameter_roles = {"head_DV": "head"}

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.scale = cfg.logits_scale * parametrization.readout_multiplier(cfg)
        self.softcap = cfg.logits_softcap
        self.head_DV = (
            None
            if cfg.tie_embeddings
            else normal(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, cfg.param_dtype)
        )
        self.bias_V = (
            nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.dtype(cfg.param_dtype)))
            if cfg.logits_bias
            else None
        )

    def __call__(self, x_BTD, embed: Embed):
        if self.scale != 1.0:
            x_BTD = x_BTD * self.scale
        if self.head_DV is None:
            logits_BTV = embed.attend(x_BTD)
        else:
            logits_BTV = dense(x_BTD, self.head_DV[...], out_dtype=wide(x_BTD))
        if self.bias_V is not None:
            logits_BTV = add_bias(logits_BTV, self.bias_V[...].astype(logits_BTV.dtype))
        if self.softcap is not None:
            logits_BTV = self.softcap * jnp.tanh(logits_BTV / self.softcap)
        return constrain(upcast(logits_BTV), "batch", "length", "act_vocab")


def checked_ids(ids_BT, vocab_size: int):
    """``ids_BT`` with ids outside ``[0, vocab_size)`` raising (concrete ids) or mapped to
    ``vocab_size``, which the embedding gather fills with NaN (traced ids)."""
    if not isinstance(ids_BT, jax.core.Tracer):
        arr = np.asarray(ids_BT)
        if not np.issubdtype(arr.dtype, np.integer):
            raise DecodeError(f"token ids must be integers, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= vocab_size)
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise DecodeError(
                f"token id {int(arr[index])} at index {index} is outside [0, vocab_size="
                f"{vocab_size}): pass ids the tokenizer produced, or raise model.vocab_size"
            )
    return jnp.where(ids_BT < 0, vocab_size, ids_BT)


class _Embedder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.tokens = Embed(cfg, rngs=rngs)

    def __call__(self, ids_BT):
        ids_BT = checked_ids(ids_BT, self.cfg.vocab_size)
        x_BTD = self.tokens(ids_BT).astype(jnp.dtype(self.cfg.dtype))
        return x_BTD * (self.cfg.d_model**0.5) if self.cfg.embed_scale else x_BTD


class _DecoderHead:
    """What a model with a ``decoder`` stack, an ``embed`` and an LM ``head`` does with
    them: the decoder's logits and the logit lens."""

    def _decoder_logits(self, tokens_BT, positions_BT, cache, *, scope=None, **kw):
        """``ModelOutput`` of ``tokens_BT`` through the decoder (after what ``cache`` holds;
        its intermediates named under ``scope`` when given), then the LM head."""
        with contextlib.nullcontext() if scope is None else probe.scope(scope):
            x_BTD, new_cache, weights, aux, stats = _run_decoder(
                self.decoder, self.embed(tokens_BT), positions_BT, cache, **kw
            )
        logits = self.head(x_BTD, self.embed.tokens)
        return ModelOutput(logits, new_cache, weights, x_BTD, aux, stats)

    def readout(self, x_BTD):
        """Logits ``[B, T, V]`` of a decoder residual stream ``x_BTD`` (a layer's captured
        ``resid_post``, say): the decoder's final norm, then the LM head, as the last layer's
        output takes them (the logit lens, ``attnlab.inspect.logit_lens``)."""
        if self.decoder.final_norm is not None:
            x_BTD = self.decoder.final_norm(x_BTD)
        return self.head(x_BTD, self.embed.tokens)


class DecoderLM(_DecoderHead, nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _Embedder(cfg, rngs=rngs)
        self.decoder = Stack(cfg, cfg.n_layers, causal=cfg.causal, cross=False, rngs=rngs)
        self.head = _LMHead(cfg, rngs=rngs)
        self.mtp = MTP(cfg, rngs=rngs) if cfg.mtp_depth else None

    def mtp_logits(self, hidden_BTD, tokens_BT, *, positions_BT=None, segment_ids_BT=None,
                   key=None, depths=None):  # fmt: skip
        """The multi-token-prediction modules' logits (``attnlab.nn.mtp``), one ``[B, T,
        V]`` per depth: depth ``k`` at position ``i`` predicts token ``i + k + 1`` from the
        decoder's last hidden state ``hidden_BTD`` and the inputs ``tokens_BT``."""
        hidden = self.mtp.hidden(
            self.decoder, self.embed, hidden_BTD, tokens_BT, positions_BT=positions_BT,
            segment_ids_BT=segment_ids_BT, key=key, depths=depths,
        )  # fmt: skip
        return self.mtp.logits(self.head, self.embed, hidden)

    def __call__(
        self,
        tokens_BT,
        *,
        positions_BT=None,
        valid_BT=None,
        segment_ids_BT=None,
        cache: KVCache | None = None,
        key=None,
        return_weights=False,
        collect=(),
    ) -> ModelOutput:
        """Logits for ``tokens``; with ``cache``, the tokens follow what the cache holds.

        ``valid_BT`` marks real tokens (keys elsewhere are masked; with a cache, each row's
        real new tokens, right-padded: the cache keeps only those); ``segment_ids_BT`` packs
        several documents into one row (attention stays within a segment). ``collect``
        names per-layer statistics to return in ``stats`` (``attnlab.nn.segments``).
        """
        return self._decoder_logits(
            tokens_BT, positions_BT, cache, valid_BS=valid_BT, segment_ids_BT=segment_ids_BT,
            key=key, return_weights=return_weights, collect=collect,
        )  # fmt: skip


class EncoderMLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _Embedder(cfg, rngs=rngs)
        self.token_types_YD = (
            normal(rngs, (cfg.type_vocab_size, cfg.d_model), cfg.init_std, cfg.param_dtype)
            if cfg.type_vocab_size
            else None
        )
        self.encoder = Stack(cfg, cfg.n_layers, causal=False, cross=False, rngs=rngs)
        if cfg.mlm_transform:
            self.transform_DD = normal(
                rngs, (cfg.d_model, cfg.d_model), cfg.init_std, cfg.param_dtype
            )
            self.transform_bias_D = nnx.Param(jnp.zeros((cfg.d_model,), jnp.dtype(cfg.param_dtype)))
            self.transform_norm = Norm(cfg, cfg.d_model, rngs=rngs)
        else:
            self.transform_DD = self.transform_bias_D = self.transform_norm = None
        self.head = _LMHead(cfg, rngs=rngs)

    def __call__(
        self,
        tokens_BT,
        *,
        valid_BT=None,
        token_types_BT=None,
        positions_BT=None,
        key=None,
        return_weights=False,
        collect=(),
    ) -> ModelOutput:
        """MLM logits and the encoder's last hidden state (``hidden``)."""
        B, T = tokens_BT.shape
        x_BTD = self.embed(tokens_BT)
        if self.token_types_YD is not None:
            types_BT = jnp.zeros_like(tokens_BT) if token_types_BT is None else token_types_BT
            x_BTD = x_BTD + jnp.take(self.token_types_YD[...], types_BT, axis=0).astype(x_BTD.dtype)
        positions_BT = _default_positions(B, T, self.cfg) if positions_BT is None else positions_BT
        hidden_BTD, _, weights, aux, stats = self.encoder(
            x_BTD,
            positions_BT=positions_BT,
            valid_BS=valid_BT,
            key=key,
            return_weights=return_weights,
            collect=collect,
        )
        h_BTD = hidden_BTD
        if self.transform_DD is not None:
            kind = self.cfg.ffn if self.cfg.ffn in ops.activations.ACTIVATIONS else "gelu"
            h_BTD = dense(h_BTD, self.transform_DD[...])
            h_BTD = ops.activations.activation(kind)(add_bias(h_BTD, self.transform_bias_D[...]))
            h_BTD = self.transform_norm(h_BTD)
        logits = self.head(h_BTD, self.embed.tokens)
        return ModelOutput(logits, None, weights, hidden_BTD, aux, stats)


class EncoderDecoder(_DecoderHead, nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _Embedder(cfg, rngs=rngs)  # shared by encoder, decoder and (tied) head
        self.encoder = Stack(cfg, cfg.n_layers, causal=False, cross=False, rngs=rngs)
        self.decoder = Stack(cfg, cfg.n_decoder_layers, causal=True, cross=True, rngs=rngs)
        self.head = _LMHead(cfg, rngs=rngs)

    def encode(self, src_BS, *, src_valid_BS=None, key=None, return_weights=False, collect=()):
        """Encoder output ``[B, S, D]`` (and per-layer weights when asked; with
        ``collect``, the pair ``(enc_BSD, stats)``)."""
        B, S = src_BS.shape
        with probe.scope("encoder"):  # the names of its intermediates: encoder.layers.{i}...
            enc_BSD, _, weights, _, stats = self.encoder(
                self.embed(src_BS),
                positions_BT=_default_positions(B, S, self.cfg),
                valid_BS=src_valid_BS,
                key=key,
                return_weights=return_weights,
                collect=collect,
            )
        if collect:
            return enc_BSD, stats
        return (enc_BSD, weights) if return_weights else enc_BSD

    def init_cross_cache(self, cache: KVCache, enc_BSD, src_valid_BS=None) -> KVCache:
        """Computes every decoder layer's cross-attention keys/values once, into the cache."""
        B, S, _ = enc_BSD.shape
        src_valid_BS = jnp.ones((B, S), bool) if src_valid_BS is None else src_valid_BS
        layers = self.decoder.layers
        if isinstance(layers, nnx.List):  # separate blocks (``Stack.unstack``)
            kv = [block.cross_attn.project_kv(enc_BSD) for block in layers]
            k_LBSKH, v_LBSKH = (jnp.stack(x) for x in zip(*kv, strict=True))
        else:
            graphdef, params = nnx.split(layers)
            project = lambda p: nnx.merge(graphdef, p).cross_attn.project_kv(enc_BSD)
            k_LBSKH, v_LBSKH = jax.vmap(project)(params)
        dtype = cache.layers["keys"].dtype if "keys" in cache.layers else jnp.dtype(self.cfg.dtype)
        head_major = lambda x: jnp.swapaxes(x, 2, 3).astype(dtype)  # [L, B, K, S, H]
        return cache.replace(
            cross={"keys": head_major(k_LBSKH), "values": head_major(v_LBSKH)},
            src_valid=src_valid_BS.astype(bool),
        )

    def decode(
        self,
        tgt_BT,
        *,
        enc_BSD=None,
        src_valid_BS=None,
        positions_BT=None,
        valid_BT=None,
        cache: KVCache | None = None,
        key=None,
        return_weights=False,
        collect=(),
    ) -> ModelOutput:
        """Decoder logits. With a cache from ``init_cross_cache``, ``enc_BSD`` is not needed.
        ``valid_BT`` marks real target tokens, as for ``DecoderLM``."""
        if cache is not None and cache.cross is not None:
            src_valid_BS = cache.src_valid
        elif enc_BSD is None:
            raise ValueError("decode needs enc_BSD, or a cache filled by init_cross_cache")
        return self._decoder_logits(
            tgt_BT, positions_BT, cache, scope="decoder",  # decoder.layers.{i}...
            valid_BS=valid_BT, enc_BSD=enc_BSD, enc_valid_BS=src_valid_BS, key=key,
            return_weights=return_weights, collect=collect,
        )  # fmt: skip

    def __call__(
        self, src_BS, tgt_BT, *, src_valid_BS=None, key=None, return_weights=False, collect=()
    ) -> ModelOutput:
        """Decoder logits for ``tgt_BT`` over the encoded source; the ``stats`` asked for
        in ``collect`` hold the encoder's layers, then the decoder's, on one layer axis."""
        if collect and return_weights:
            raise ValueError("collect and return_weights: ask for one at a time")
        enc = self.encode(
            src_BS, src_valid_BS=src_valid_BS, key=fold(key, 0), return_weights=return_weights,
            collect=collect,
        )  # fmt: skip
        enc_BSD, enc_extra = enc if (return_weights or collect) else (enc, None)
        out = self.decode(
            tgt_BT,
            enc_BSD=enc_BSD,
            src_valid_BS=src_valid_BS,
            key=fold(key, 1),
            return_weights=return_weights,
            collect=collect,
        )
        if collect:
            joined = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), enc_extra, out.stats)
            out = out.replace(stats=joined)
        enc_weights = enc_extra
        if return_weights:
            out = out.replace(weights={"encoder": enc_weights, "decoder": out.weights})
        return out


MODEL_CLASSES.update(decoder=DecoderLM, encoder=EncoderMLM, encoder_decoder=EncoderDecoder)


__getattr__ = _moved.module_getattr(__name__)  # the previous release's names, deprecated
