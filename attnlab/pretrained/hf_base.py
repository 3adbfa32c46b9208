"""Shared pieces of the config.json translators: required and rejected keys, activations,
RoPE settings, the error type."""

from __future__ import annotations

from attnlab.errors import PretrainedError


class UnsupportedCheckpointError(PretrainedError, ValueError):
    """The checkpoint's family, or one of its config.json settings, has no attnlab equivalent."""


# Hugging Face activation names -> (plain FFN kind, gated FFN kind).
_ACTIVATIONS = {
    "relu": ("relu", None),
    "relu2": ("relu2", None),
    "gelu": ("gelu", "geglu"),
    "gelu_new": ("gelu_tanh", "geglu_tanh"),
    "gelu_pytorch_tanh": ("gelu_tanh", "geglu_tanh"),
    "gelu_fast": ("gelu_tanh", "geglu_tanh"),
    "silu": ("silu", "swiglu"),
    "swish": ("silu", "swiglu"),
    "xielu": ("xielu", None),
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


def checked_layer_types(types, n: int, allowed) -> list:
    """config.json's ``layer_types`` as a list, checked to give each of the ``n`` layers one
    of ``allowed``."""
    if len(types) != n or set(types) - set(allowed):
        raise UnsupportedCheckpointError(
            f"config.json layer_types={types!r} is not supported: give num_hidden_layers={n} "
            f"entries, each one of {list(allowed)}"
        )
    return list(types)


def pad_id_of(c: dict, vocab_size: int) -> int:
    pad = c.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < vocab_size else 0


# Hugging Face rope_type -> the RopeScaling fields it reads: (ours, theirs, default).
_SCALINGS = {
    "linear": (),
    "llama3": (
        ("original_max_len", "original_max_position_embeddings", None),
        ("low_freq_factor", "low_freq_factor", None),
        ("high_freq_factor", "high_freq_factor", None),
    ),
    "yarn": (
        ("original_max_len", "original_max_position_embeddings", None),
        ("beta_fast", "beta_fast", 32.0),
        ("beta_slow", "beta_slow", 1.0),
        ("truncate", "truncate", True),
        ("mscale", "mscale", None),
        ("mscale_all_dim", "mscale_all_dim", None),
        ("attention_factor", "attention_factor", None),
    ),
    "longrope": (
        ("original_max_len", "original_max_position_embeddings", None),
        ("short_factor", "short_factor", None),
        ("long_factor", "long_factor", None),
        ("attention_factor", "attention_factor", None),
    ),
}


def _rope_kind(spec: dict) -> str:
    kind = spec.get("rope_type", spec.get("type", "default"))
    return "longrope" if kind == "su" else kind  # Phi-3's older name


def _rope_spec(c: dict, key: str, spec: dict, *, scaled: bool) -> None:
    kind = _rope_kind(spec)
    if kind != "default" and not (scaled and kind in _SCALINGS):
        supported = ["default", *_SCALINGS] if scaled else ["default"]
        raise UnsupportedCheckpointError(
            f"config.json {key}.rope_type={kind!r} is not supported for this family: "
            f"attnlab reads rope_type {supported}"
        )


def rope_scaling_of(c: dict, layer_type: str | None = None) -> dict | None:
    """``ModelConfig.rope_scaling`` from ``rope_parameters`` (or the older ``rope_scaling``;
    ``layer_type``: that entry of per-layer-type ``rope_parameters``): None for plain RoPE.
    A ``factor`` or ``original_max_position_embeddings`` left out is derived as
    transformers derives it (from ``max_position_embeddings``)."""
    spec, key = c.get("rope_scaling") or {}, "rope_scaling"
    if _rope_kind(spec) == "default":
        spec, key = c.get("rope_parameters") or {}, "rope_parameters"
        if layer_type is not None and isinstance(spec.get(layer_type), dict):
            spec, key = spec[layer_type], f"rope_parameters.{layer_type}"
    kind = _rope_kind(spec)
    if kind == "default":
        return None
    _rope_spec(c, key, spec, scaled=True)
    out = {"kind": kind}
    for ours, theirs, default in _SCALINGS[kind]:
        value = spec.get(theirs, c.get(theirs) if theirs.startswith("original") else None)
        value = default if value is None else value
        if value is not None:
            out[ours] = value
    if kind == "longrope" and c.get("original_max_position_embeddings"):
        # Phi-3's config reads its top-level field over the one in rope_parameters.
        out["original_max_len"] = c["original_max_position_embeddings"]
    if kind in ("yarn", "longrope") and "original_max_len" not in out:
        out["original_max_len"] = require(c, "max_position_embeddings")
    factor = spec.get("factor")
    if factor is None and kind in ("yarn", "longrope"):
        factor = require(c, "max_position_embeddings") / out["original_max_len"]
    out["factor"] = float(require({"factor": factor}, "factor"))
    return out


def rope_theta_of(
    c: dict, *, partial: bool = False, layer_type: str | None = None, scaled: bool = False
) -> float:
    """The RoPE base; ``partial``: the family reads ``partial_rotary_factor`` itself;
    ``layer_type``: the entry of per-layer-type ``rope_parameters`` (Gemma 3); ``scaled``:
    the family reads a scaling of the frequencies (``rope_scaling_of``)."""
    params = c.get("rope_parameters") or {}
    key = "rope_parameters"
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params, key = params[layer_type], f"rope_parameters.{layer_type}"
    _rope_spec(c, key, params, scaled=scaled)
    _rope_spec(c, "rope_scaling", c.get("rope_scaling") or {}, scaled=scaled)
    if not partial and rotary_fraction(c) != 1.0:
        raise UnsupportedCheckpointError(
            f"config.json partial_rotary_factor={rotary_fraction(c)} is not supported"
        )
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def rotary_fraction(c: dict) -> float:
    """``partial_rotary_factor`` (v5: inside ``rope_parameters``), 1.0 when absent."""
    params = c.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))


# The older transformers (GPT-2, BERT, BART) have a bias on every projection.
ALL_BIASES = {"attn_bias": True, "out_bias": True, "ffn_bias": True}


def common_fields(c: dict, **fields) -> dict:
    fields.setdefault("pad_id", pad_id_of(c, fields["vocab_size"]))
    return fields


def decoder_fields(c: dict, **fields) -> dict:
    """A pre-norm RMSNorm decoder without positions and with a gated FFN, read from a
    Llama-style config.json; ``fields`` add to or override what it reads (the layer count and
    the FFN kind are read only when ``fields`` lack them)."""
    D, N = require(c, "hidden_size"), require(c, "num_attention_heads")
    read = dict(
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=D,
        n_layers=fields["n_layers"] if "n_layers" in fields else require(c, "num_hidden_layers"),
        n_heads=N,
        n_kv_heads=c.get("num_key_value_heads") or N,
        head_dim=c.get("head_dim") or D // N,
        d_ff=require(c, "intermediate_size"),
        max_len=c.get("max_position_embeddings") or 2048,
        position="none",
        norm="rmsnorm",
        norm_eps=c.get("rms_norm_eps", 1e-6),
        norm_placement="pre",
        ffn=fields["ffn"] if "ffn" in fields else ffn_kind(c, "hidden_act", "silu", gated=True),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
    return common_fields(c, **{**read, **fields})


def rope_decoder_fields(c: dict, *, rotary: dict | None = None, **fields) -> dict:
    """``decoder_fields`` with RoPE (a share of each head rotated, from ``rotary``'s
    ``partial_rotary_factor`` or ``c``'s); ``fields`` add to or override what it reads."""
    D, N = require(c, "hidden_size"), require(c, "num_attention_heads")
    H = c.get("head_dim") or D // N
    fraction = rotary_fraction(c if rotary is None else rotary)
    read = dict(
        position="rope",
        rope_theta=rope_theta_of(c, partial=True, scaled=True),
        rope_scaling=rope_scaling_of(c),
        rotary_dim=None if fraction == 1.0 else int(H * fraction),
    )
    return decoder_fields(c, **{**read, **fields})


def prefix_and_block(kinds: list) -> dict:
    """``ModelConfig.block_pattern`` of per-layer ``kinds``: a ``block`` repeated to the end
    after a ``prefix``, the shortest together (a prefix as short as can be among those), so a
    regular stack scans one block and any other still loads, its irregular start unrolled."""
    n = len(kinds)
    best = None
    for p in range(n):
        rest = kinds[p:]
        k = next(
            k for k in range(1, n - p + 1) if (n - p) % k == 0 and rest == rest[:k] * ((n - p) // k)
        )
        if best is None or p + k < sum(best):
            best = (p, k)
    p, k = best
    return {"prefix": kinds[:p], "block": kinds[p : p + k]}
