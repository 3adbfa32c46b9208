"""The logit lens: each layer's residual stream read out through the final norm and the
unembedding, as if the model stopped there (nostalgebraist, "interpreting GPT: the logit
lens", 2020). The last layer's reading is the model's own logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab.errors import InspectError
from attnlab.inspect.capture import _call, _split_kwargs, model_of, one_line_errors
from attnlab.nn.probe import Probe


def _readout(model):
    """``x_BTD -> logits_BTV`` through the decoder stack's final norm and the LM head
    (the model's ``readout``)."""
    if not hasattr(model, "readout"):
        raise InspectError(
            f"the logit lens reads a decoder's residual stream; {type(model).__name__} has no "
            "decoder stack: use a DecoderLM or an EncoderDecoder"
        )
    return model.readout


@functools.partial(jax.jit, static_argnames=("graphdef", "name", "static", "method"))
def _lens(graphdef, state, args, kwargs, *, name, static, method):
    model = nnx.merge(graphdef, state)
    with Probe((name,), ()) as probe:
        out = _call(model, args, kwargs, static, method)
    probe.check(None)
    readout = _readout(model)
    layers = sorted(probe.captured, key=lambda n: int(n.split("layers.", 1)[1].split(".")[0]))
    return jnp.stack([readout(probe.captured[n]) for n in layers]), out.logits


@one_line_errors
def logit_lens(model, *args, name: str = "resid_post", method: str | None = None, **kwargs):
    """``[L, B, T, V]`` float32 logits of every layer's ``name`` (``"resid_post"``, or
    ``"resid_mid"``...) through the final norm and the unembedding, and the model's logits
    ``[B, T, V]``: ``(lens, logits)``. An encoder-decoder reads its decoder's layers
    (``method="decode"`` or the full call)."""
    module = model_of(model)
    _readout(module)  # fails early for a model without a decoder
    prefix = "decoder." if hasattr(module, "encoder") and hasattr(module, "decoder") else ""
    graphdef, state = nnx.split(module)
    arrays, static = _split_kwargs(kwargs)
    return _lens(graphdef, state, tuple(args), arrays, name=f"{prefix}layers.*.{name}",
                 static=static, method=method)  # fmt: skip
