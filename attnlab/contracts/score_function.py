"""Score functions: the attention function a softmax-attention layer calls, selectable by name
from ``ModelConfig.attention_fn`` (a registry).

The contract. A score function is called as::

    fn(q_BTNH, k_BSKH, v_BSKH, *, mask, bias, scale, return_weights, implementation,
       dropout_rate, dropout_key, backend)

with ``k``/``v`` holding K <= N heads (GQA/MQA: K divides N), a ``mask`` (True = may
attend) or None, an additive ``bias`` or None, the logit ``scale``, ``implementation`` from
``ModelConfig.attention_impl``, attention dropout (``dropout_key`` is None when no
dropout applies: evaluation, decoding) and the ``backend`` the model was built for (what
``"auto"`` chooses a path by). It returns ``out_BTNH``, or
``(out_BTNH, weights_BNTS)`` when ``return_weights``. ``register_attention`` checks the
signature (a ``**kwargs`` catch-all satisfies every keyword).

The model passes the mask and the bias as descriptions, an ``ops.MaskSpec`` and an
``ops.PositionBias`` (one mask type, resolved in ``ops.dot_product_attention``: block by
block on the chunked path, ``mask.dense()`` / ``bias.dense()`` elsewhere), and, when the
config sets ``attention_block_q``/``attention_block_k``, the keywords ``block_q``/``block_k``
too. A variant that forwards them to ``dot_product_attention`` keeps every path; one that
needs arrays calls ``.dense()``.

A score function changes the scores alone, best as a ``score_mod(score, b, h, q_idx,
kv_idx)`` passed to ``dot_product_attention`` (``attnlab.ops.score_mods``): every path
then runs it, the chunked one and the fused kernels included, with no kernel code of the
variant's own (a whole-array ``logits_fn`` keeps the dense reference path). A variant with
its own parameters or cache entries is a module (``attnlab.contracts.mixer``, ``ModelConfig.mixer``)
that passes its ``score_mod`` the same way (``attnlab.nn.mixers.forgetting``).

The function is resolved when a model is built and held by its attention modules, so it is
part of the model's graph: every compiled program (training, evaluation, cached decoding)
of a model runs the same function, and re-registering a name changes what models built
afterwards run. An experiment file may register the variants it uses, so runs that use
them can be reopened from their work directory::

    def capped(q, k, v, **kw):
        return attnlab.ops.dot_product_attention(
            q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: 30.0 * jnp.tanh(s / 30.0), **kw)

    attnlab.register_attention("softcap30", capped)
    cfg = cfg.replace(attention_fn="softcap30")
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from attnlab.ops.attention import dot_product_attention

CONTRACT_KEYWORDS = (
    "mask",
    "bias",
    "scale",
    "return_weights",
    "implementation",
    "dropout_rate",
    "dropout_key",
    "backend",
)

_REGISTRY: dict[str, Callable] = {"softmax": dot_product_attention}


def check_contract(name: str, fn: Callable) -> None:
    """Raises ``TypeError`` when ``fn`` cannot be called as the variant contract says."""
    if not callable(fn):
        raise TypeError(f"register_attention: {name!r} must map to a callable, got {fn!r}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # builtins and C functions: nothing to inspect
    kinds = inspect.Parameter
    by_position = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    positional = [p for p in params if p.kind in by_position]
    if len(positional) < 3 and not any(p.kind == kinds.VAR_POSITIONAL for p in params):
        raise TypeError(
            f"attention variant {name!r} must take q, k, v as its first three positional "
            f"arguments; its signature is {inspect.signature(fn)}"
        )
    if any(p.kind == kinds.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind != kinds.POSITIONAL_ONLY}
    missing = [k for k in CONTRACT_KEYWORDS if k not in names]
    if missing:
        raise TypeError(
            f"attention variant {name!r} does not accept the keyword(s) {missing} of the "
            f"variant contract (see attnlab.contracts.score_function); add them or a "
            "**kwargs catch-all"
        )


def register_attention(name: str, fn: Callable, *, overwrite: bool = False) -> None:
    """Makes ``fn`` available as ``ModelConfig(attention_fn=name)``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_attention: the name must be a non-empty str, got {name!r}")
    check_contract(name, fn)
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not fn:
        raise ValueError(f"attention variant {name!r} exists; pass overwrite=True to replace it")
    _REGISTRY[name] = fn


def attention_variants() -> dict[str, Callable]:
    """The registered score functions by name, the built-in ones included."""
    return dict(_REGISTRY)


def get_attention(name: str) -> Callable:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"attention_fn={name!r} is not registered; known: {sorted(_REGISTRY)}"
        ) from None
