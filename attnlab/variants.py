"""Registry of attention functions selectable by name from ``ModelConfig.attention_fn``.

A variant is any function with the signature of ``attnlab.ops.dot_product_attention``.
Registering one makes it usable by every model through the config, with no library edit::

    def capped(q, k, v, **kw):
        return attnlab.ops.dot_product_attention(
            q, k, v, logits_fn=lambda s: 30.0 * jnp.tanh(s / 30.0), **kw)

    attnlab.register_attention("softcap30", capped)
    cfg = cfg.replace(attention_fn="softcap30")
"""

from __future__ import annotations

from collections.abc import Callable

from attnlab.ops.attention import dot_product_attention

_REGISTRY: dict[str, Callable] = {"softmax": dot_product_attention}


def register_attention(name: str, fn: Callable, *, overwrite: bool = False) -> None:
    """Makes ``fn`` available as ``ModelConfig(attention_fn=name)``."""
    if not callable(fn):
        raise TypeError(f"register_attention: {name!r} must map to a callable, got {fn!r}")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not fn:
        raise ValueError(f"attention variant {name!r} exists; pass overwrite=True to replace it")
    _REGISTRY[name] = fn


def attention_variants() -> dict[str, Callable]:
    return dict(_REGISTRY)


def get_attention(name: str) -> Callable:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"attention_fn={name!r} is not registered; known: {sorted(_REGISTRY)}"
        ) from None
