"""SmolLM3: a Llama-shaped decoder whose attention skips RoPE in some layers (NoPE, every
fourth by default: ``no_rope_layers``, 1 = rotate), as ``layer_pattern`` entries with
``rope=False``; sliding windows only where ``use_sliding_window`` and ``layer_types`` say."""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config
from attnlab.pretrained.families.llama import LLAMA, llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import UnsupportedCheckpointError, require

_TYPES = ("sliding_attention", "full_attention")


def _per_layer(c: dict, key: str, default: list, allowed: tuple) -> list:
    n = require(c, "num_hidden_layers")
    value = c.get(key)
    value = default if value is None else list(value)
    if len(value) != n or any(v not in allowed for v in value):
        raise UnsupportedCheckpointError(
            f"config.json {key}={value!r} is not supported: give num_hidden_layers={n} "
            f"entries, each one of {list(allowed)}"
        )
    return value


def smollm3(c: dict) -> dict:
    n = require(c, "num_hidden_layers")
    every = c.get("no_rope_layer_interval", 4)
    rotates = _per_layer(
        c, "no_rope_layers", [int((i + 1) % every != 0) for i in range(n)], (0, 1, True, False)
    )
    types = _per_layer(c, "layer_types", ["full_attention"] * n, _TYPES)
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    pattern = [
        {"window": window if t == "sliding_attention" else None, "rope": bool(r)}
        for t, r in zip(types, rotates, strict=True)
    ]
    plain = {k: v for k, v in c.items() if k not in ("layer_types", "use_sliding_window")}
    return llama_like(plain, layer_pattern=pattern, sliding_window=None, sliding_window_layers=None)


def smollm3_writer(cfg):
    windows = cfg.layer_windows(cfg.n_layers)
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"windows {windows}: SmolLM3's layers share one window size")
    out = base_config(cfg, "smollm3", "SmolLM3ForCausalLM")
    out["mlp_bias"] = False
    out["no_rope_layers"] = [int(theta is not None) for theta, _ in cfg.layer_ropes(cfg.n_layers)]
    out["use_sliding_window"] = bool(sizes)
    out["sliding_window"] = sizes.pop() if sizes else None
    out["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in windows]
    return out


register_family(
    Family(
        "smollm3", config=smollm3, mapping=LLAMA, write=smollm3_writer, architectures=("SmolLM3",)
    )
)
