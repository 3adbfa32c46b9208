"""Shared pieces of the config.json translators: required and rejected keys, activations,
RoPE settings, the error type."""

from __future__ import annotations

from attnlab.errors import PretrainedError


class UnsupportedCheckpointError(PretrainedError, ValueError):
    """The checkpoint's family, or one of its config.json settings, has no attnlab equivalent."""


# Hugging Face activation names -> (plain FFN kind, gated FFN kind).
_ACTIVATIONS = {
    "relu": ("relu", None),
    "gelu": ("gelu", "geglu"),
    "gelu_new": ("gelu_tanh", "geglu_tanh"),
    "gelu_pytorch_tanh": ("gelu_tanh", "geglu_tanh"),
    "gelu_fast": ("gelu_tanh", "geglu_tanh"),
    "silu": ("silu", "swiglu"),
    "swish": ("silu", "swiglu"),
}


def ffn_kind(c: dict, key: str, default: str, *, gated: bool, name: str | None = None) -> str:
    """The FFN kind of activation ``c[key]`` (or ``name``, derived from that key)."""
    name = name or c.get(key) or default
    kinds = _ACTIVATIONS.get(name)
    kind = None if kinds is None else kinds[gated]
    if kind is None:
        supported = [k for k, v in _ACTIVATIONS.items() if v[gated] is not None]
        raise UnsupportedCheckpointError(
            f"config.json {key}={c.get(key, default)!r} (activation {name!r}) has no attnlab "
            f"{'gated ' if gated else ''}FFN equivalent; supported activations: {supported}"
        )
    return kind


def require(c: dict, key: str):
    if c.get(key) is None:
        raise UnsupportedCheckpointError(f"config.json lacks the required field {key!r}")
    return c[key]


def reject(c: dict, key: str, bad, why: str):
    """Raises when ``c[key]`` is one of the values attnlab cannot reproduce."""
    value = c.get(key)
    hit = value in bad if isinstance(bad, tuple) else bad(value)
    if hit:
        raise UnsupportedCheckpointError(f"config.json {key}={value!r} is not supported: {why}")


def pad_id_of(c: dict, vocab_size: int) -> int:
    pad = c.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < vocab_size else 0


def _rope_spec(c: dict, key: str, spec: dict) -> None:
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind != "default":
        raise UnsupportedCheckpointError(
            f"config.json {key}.rope_type={kind!r} is not supported: attnlab implements "
            "plain RoPE only (rope_type 'default')"
        )


def rope_theta_of(c: dict, *, partial: bool = False, layer_type: str | None = None) -> float:
    """The RoPE base; ``partial``: the family reads ``partial_rotary_factor`` itself;
    ``layer_type``: the entry of per-layer-type ``rope_parameters`` (Gemma 3)."""
    params = c.get("rope_parameters") or {}
    key = "rope_parameters"
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params, key = params[layer_type], f"rope_parameters.{layer_type}"
    _rope_spec(c, key, params)
    _rope_spec(c, "rope_scaling", c.get("rope_scaling") or {})
    if not partial and rotary_fraction(c) != 1.0:
        raise UnsupportedCheckpointError(
            f"config.json partial_rotary_factor={rotary_fraction(c)} is not supported"
        )
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def rotary_fraction(c: dict) -> float:
    """``partial_rotary_factor`` (v5: inside ``rope_parameters``), 1.0 when absent."""
    params = c.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))


def common_fields(c: dict, **fields) -> dict:
    fields.setdefault("pad_id", pad_id_of(c, fields["vocab_size"]))
    return fields
