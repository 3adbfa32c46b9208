"""``Pretrained``: a loaded checkpoint with a Hugging Face-like calling convention.

Inputs are NumPy or JAX arrays of token ids, batch first (``[B, T]``), and an optional
``attention_mask`` (1 = real token, 0 = padding) of the same shape. Positions are
``0..T-1`` in every row and padded keys are masked for every query, the convention of a
Hugging Face forward pass with ``attention_mask`` and no ``position_ids``; with right padding
the real tokens' outputs do not depend on the padding. Token ids are checked against the
vocabulary first, since JAX gathers clamp out-of-range ids silently.

Each method runs a function jitted once per (method, input shapes), with the model split
once, when the handle is made (``graphdef``, ``state``), and merged inside the jitted
function. To change the weights, make a new handle.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.decode import checks
from attnlab.pretrained.family import family_of

# name -> jitted function of (graphdef, state, *arrays); shared by every handle.
_COMPILED = {}


def _first_id(value):
    if isinstance(value, list | tuple):
        return value[0] if value else None
    return value


class Pretrained:
    """A checkpoint loaded by ``attnlab.load_pretrained``.

    Attributes: ``model`` (the NNX module), ``config`` (its ``ModelConfig``), ``hf_config``
    (the config.json dict), ``family`` (its model_type), ``path``, the special ids
    ``pad_id``, ``eos_id``, ``bos_id`` and ``decoder_start_id`` (None where absent), and the
    model split once: ``graphdef`` and ``state``.
    """

    def __init__(self, model, *, hf_config: dict, generation_config=None, path=None):
        self.model = model
        self.graphdef, self.state = nnx.split(model)
        self.config: ModelConfig = model.cfg
        self.hf_config = hf_config
        self.generation_config = generation_config or {}
        self.family = family_of(hf_config)
        self.path = None if path is None else os.fspath(path)

    def __repr__(self):
        cfg = self.config
        return (
            f"Pretrained({self.family}, arch={cfg.arch}, d_model={cfg.d_model}, "
            f"layers={cfg.n_layers}, vocab={cfg.vocab_size}, path={self.path!r})"
        )

    # Special ids ----------------------------------------------------------------------
    def _special(self, key):
        value = self.generation_config.get(key, self.hf_config.get(key))
        return _first_id(value)

    @property
    def pad_id(self) -> int:
        return self.config.pad_id

    @property
    def eos_id(self) -> int | None:
        return self._special("eos_token_id")

    @property
    def bos_id(self) -> int | None:
        return self._special("bos_token_id")

    @property
    def decoder_start_id(self) -> int | None:
        return self._special("decoder_start_token_id")

    @property
    def params(self):
        """The model's parameters (an ``nnx.State``)."""
        return nnx.state(self.model, nnx.Param)

    # Input checks -----------------------------------------------------------------------
    def _ids(self, ids, name="input_ids", *, limit=None, what="vocab_size"):
        limit = self.config.vocab_size if limit is None else limit
        x = np.asarray(ids)
        if x.ndim != 2:
            raise ValueError(f"{name} must be [batch, length], got shape {x.shape}; use ids[None]")
        checks.check_ids(x, limit, name, what=what)
        if name != "token_type_ids":
            checks.check_length(name, x.shape[1], self.config.max_len)
        return jnp.asarray(x, jnp.int32)

    def _mask(self, mask, ids, name="attention_mask"):
        if mask is None:
            return None
        m = np.asarray(mask)
        if m.shape != tuple(ids.shape):
            raise ValueError(f"{name} has shape {m.shape}, expected {tuple(ids.shape)}")
        if not np.isin(m, (0, 1)).all():
            raise ValueError(f"{name} must hold 0 (padding) and 1 (token) only")
        return jnp.asarray(m, bool)

    def _types(self, token_type_ids, ids):
        if token_type_ids is None:
            return None
        types = self._ids(
            token_type_ids,
            "token_type_ids",
            limit=self.config.type_vocab_size,
            what="type_vocab_size",
        )
        if types.shape != ids.shape:
            raise ValueError(f"token_type_ids has shape {types.shape}, expected {ids.shape}")
        return types

    def _need(self, *archs):
        if self.config.arch not in archs:
            raise TypeError(f"{self.family} ({self.config.arch}) checkpoints have no such output")

    # Running --------------------------------------------------------------------------
    def _run(self, name, fn, *args):
        """``fn(model, *args)`` under a ``jax.jit`` built once per name (which fixes what
        ``fn`` computes); the graph is a static argument, so models of one graph share it."""
        if name not in _COMPILED:
            _COMPILED[name] = jax.jit(lambda g, s, *a: fn(nnx.merge(g, s), *a), static_argnums=0)
        return _COMPILED[name](self.graphdef, self.state, *args)

    def _forward(
        self, input_ids, attention_mask, decoder_input_ids, token_type_ids, return_weights=False
    ):
        arch = self.config.arch
        ids = self._ids(input_ids)
        valid = self._mask(attention_mask, ids)
        if arch == "decoder":
            if decoder_input_ids is not None or token_type_ids is not None:
                raise TypeError("decoder-only models take input_ids and attention_mask only")
            return self._run(
                f"decoder{return_weights}",
                lambda m, t, v: m(t, valid_BT=v, return_weights=return_weights),
                ids,
                valid,
            )
        if arch == "encoder":
            return self._run(
                f"encoder{return_weights}",
                lambda m, t, v, tt: m(
                    t, valid_BT=v, token_types_BT=tt, return_weights=return_weights
                ),
                ids,
                valid,
                self._types(token_type_ids, ids),
            )
        if decoder_input_ids is None:
            raise TypeError("encoder-decoder models need decoder_input_ids")
        return self._run(
            f"seq2seq{return_weights}",
            lambda m, s, t, v: m(s, t, src_valid_BS=v, return_weights=return_weights),
            ids,
            self._ids(decoder_input_ids, "decoder_input_ids"),
            valid,
        )

    def logits(
        self, input_ids, attention_mask=None, *, decoder_input_ids=None, token_type_ids=None
    ) -> jax.Array:
        """Logits ``[B, T, V]``, float32 (float64 for a float64 model): decoder logits for
        encoder-decoder models, MLM logits for encoders."""
        return self._forward(input_ids, attention_mask, decoder_input_ids, token_type_ids).logits

    def mlm_logits(self, input_ids, attention_mask=None, token_type_ids=None) -> jax.Array:
        """Masked-language-model logits ``[B, T, V]`` of an encoder (BERT)."""
        self._need("encoder")
        return self.logits(input_ids, attention_mask, token_type_ids=token_type_ids)

    def hidden_states(
        self, input_ids, attention_mask=None, token_type_ids=None, *, decoder_input_ids=None
    ) -> jax.Array:
        """The last hidden state ``[B, T, D]``: the encoder output of an encoder, the final
        (normed) decoder state of a decoder or encoder-decoder."""
        out = self._forward(input_ids, attention_mask, decoder_input_ids, token_type_ids)
        return out.hidden

    def encode(self, input_ids, attention_mask=None) -> jax.Array:
        """Encoder output ``[B, S, D]`` of an encoder-decoder model."""
        self._need("encoder_decoder")
        ids = self._ids(input_ids)
        return self._run(
            "encode",
            lambda m, s, v: m.encode(s, src_valid_BS=v),
            ids,
            self._mask(attention_mask, ids),
        )

    def attention(
        self,
        input_ids,
        *,
        layer: int,
        attention_mask=None,
        decoder_input_ids=None,
        token_type_ids=None,
        stack: str | None = None,
        kind: str = "self",
    ) -> jax.Array:
        """Attention weights ``[B, N, T, S]`` of one layer (float32 or the model's wider
        dtype, rows sum to 1).

        Encoder-decoder models pick ``stack`` ("encoder" or "decoder", default "decoder")
        and, on the decoder, ``kind`` ("self" or "cross").
        """
        out = self._forward(
            input_ids, attention_mask, decoder_input_ids, token_type_ids, return_weights=True
        )
        weights = out.weights
        if self.config.arch == "encoder_decoder":
            stack = stack or "decoder"
            if stack not in ("encoder", "decoder"):
                raise ValueError(f"stack={stack!r}: use 'encoder' or 'decoder'")
            weights = weights[stack]
        elif stack is not None:
            raise ValueError(f"stack={stack!r} applies to encoder-decoder models only")
        if not 0 <= layer < len(weights):
            raise ValueError(f"layer={layer} is out of range: the stack has {len(weights)}")
        if kind not in weights[layer]:
            raise ValueError(f"kind={kind!r}: this layer has {sorted(weights[layer])}")
        return weights[layer][kind]

    # Generation -----------------------------------------------------------------------
    def decoding_parts(self):
        """``(graphdef, state, config, special ids)``: what ``attnlab.generate`` runs."""
        special = dict(eos_id=self.eos_id, start_id=self.decoder_start_id)
        return self.graphdef, self.state, self.config, special

    def generate(
        self, prompt_ids, max_new_tokens: int, *, attention_mask=None, eos_id="config", **options
    ):
        """Generates with ``attnlab.generate`` (the KV-cache decoder, greedy by default).

        Decoder-only: ``prompt_ids`` ``[B, T]``, right-padded rows marked by
        ``attention_mask``. Encoder-decoder: ``prompt_ids`` are source ids and decoding
        starts from the checkpoint's ``decoder_start_token_id``. ``eos_id="config"`` stops
        at the checkpoint's (first) eos id, ``None`` never stops early. ``options``
        (temperature, top_k, top_p, seed, num_beams, ...) go to ``attnlab.generate``.
        Returns its ``GenerationResult`` (``.tokens`` holds the generated ids only).
        """
        from attnlab.decode import generate

        if self.config.arch == "encoder":
            raise TypeError(f"{self.family} is an encoder: it does not generate")
        ids = self._ids(prompt_ids)
        mask = self._mask(attention_mask, ids)
        if mask is not None and self.config.arch == "decoder":
            m = np.asarray(mask)
            lengths = m.sum(1)
            if not (m == (np.arange(m.shape[1])[None, :] < lengths[:, None])).all():
                raise ValueError("attention_mask must mark right-padded prompts (1s then 0s)")
            options["prompt_lengths"] = lengths
        elif mask is not None:
            options["source_valid"] = np.asarray(mask)
        return generate(self, ids, max_new_tokens, eos_id=eos_id, **options)

    def generate_text(self, prompts, max_new_tokens: int = 32, **options):
        """Continuations of a prompt (str) or prompts (list) as text, through the folder's
        ``tokenizer.json``; the ids are those of ``generate`` (``options`` go to it)."""
        from attnlab.pretrained.text import generate_text

        return generate_text(self, prompts, max_new_tokens, **options)
