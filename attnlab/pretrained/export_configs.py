"""Shared pieces of the config.json writers (each family's writer lives in its file under
``attnlab/pretrained/families``): a ``ModelConfig`` -> the dict the family's translator reads
back as that config. A writer may write what its family cannot express (a ValueError where it
sees it); ``export.hf_config_of`` keeps it only when the config read back computes the same
model."""

from __future__ import annotations

from attnlab.config import ModelConfig
from attnlab.config.layer_kinds import stack_plan

# attnlab gated FFN kinds -> Hugging Face activation names.
_ACT = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}


def base_config(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
    """The config.json keys of a Llama-shaped decoder (``model_type``, its class name)."""
    if cfg.arch != "decoder":
        raise ValueError(f"arch={cfg.arch!r}: export-hf writes decoder-only models")
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": _ACT.get(cfg.ffn, cfg.ffn),
        "rope_parameters": rope_parameters(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attn_bias,
        "pad_token_id": cfg.pad_id,
        "dtype": "float32",
    }


# ModelConfig.rope_scaling's fields -> the rope_parameters keys transformers reads.
_SCALING_KEYS = {
    "factor": "factor",
    "original_max_len": "original_max_position_embeddings",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "truncate": "truncate",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "attention_factor": "attention_factor",
    "short_factor": "short_factor",
    "long_factor": "long_factor",
}
_READS = {  # what each rope_type reads besides factor (the rest are left out)
    "linear": (),
    "llama3": ("original_max_len", "low_freq_factor", "high_freq_factor"),
    "yarn": ("original_max_len", "beta_fast", "beta_slow", "truncate", "mscale",
             "mscale_all_dim", "attention_factor"),
    "longrope": ("original_max_len", "short_factor", "long_factor", "attention_factor"),
}  # fmt: skip


def rope_parameters(cfg: ModelConfig) -> dict:
    out = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    if s is not None:
        out = {**out, "rope_type": s.kind, "factor": s.factor}
        for name in _READS[s.kind]:
            value = getattr(s, name)
            if value is not None:
                out[_SCALING_KEYS[name]] = list(value) if isinstance(value, tuple) else value
    return out


def window_fields(cfg: ModelConfig) -> dict:
    """``layer_types`` and ``sliding_window`` of the per-layer windows (one window size)."""
    windows = cfg.layer_windows(cfg.n_layers)
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"windows {windows}: a family's layers share one window size")
    types = ["full_attention" if w is None else "sliding_attention" for w in windows]
    # transformers wants a window even when no layer slides; then it is never used.
    return {"sliding_window": sizes.pop() if sizes else cfg.max_len, "layer_types": types}


def rope_by_layer_type(cfg: ModelConfig, layer_types: list, family: str) -> dict:
    """``rope_parameters`` of a family with a RoPE base per layer type (``layer_types``, as
    ``window_fields`` writes them): the full layers' with the scaling, the sliding layers'
    plain; a ValueError when two layers of one type differ."""
    thetas = cfg.layer_rope_thetas(cfg.n_layers)
    types = ("full_attention", "sliding_attention")
    by_type = {k: {t for t, kk in zip(thetas, layer_types, strict=True) if kk == k} for k in types}
    if any(len(v) > 1 for v in by_type.values()):
        raise ValueError(f"{family} has one RoPE base per layer type")
    full = by_type["full_attention"].pop() if by_type["full_attention"] else cfg.rope_theta
    local = by_type["sliding_attention"].pop() if by_type["sliding_attention"] else cfg.rope_theta
    return {
        "full_attention": {**rope_parameters(cfg), "rope_theta": full},
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }


def experts(cfg, **fixed) -> dict:
    """``num_local_experts`` and ``num_experts_per_tok`` (ffn_variant "moe" only)."""
    s = cfg.ffn_settings
    if getattr(cfg, "ffn_variant", "dense") != "moe":
        raise ValueError("ffn_variant is not 'moe'")
    return {"num_local_experts": s.n_experts, "num_experts_per_tok": s.top_k, **fixed}


def single_mixers(cfg, family: str, names: dict) -> list:
    """Each layer's one mixer (a ``MixerSpec``); a ValueError naming the first layer whose
    mixers ``family`` has no layer type for."""
    out = []
    for i, kind in enumerate(stack_plan(cfg, cfg.n_layers).kinds):
        mixers = [m.mixer for m in kind.mixers]
        if len(mixers) != 1 or mixers[0] not in names:
            raise ValueError(
                f"layer {i}'s mixers {mixers}: {family} layers hold one of {sorted(names)}"
            )
        out.append(kind.mixers[0])
    return out


INFINITY = {"__float__": "Infinity"}  # as transformers 5 writes it


def mamba2_keys(s, keys: dict) -> dict:
    """Resolved ``mamba2`` settings ``s`` under config.json ``keys`` (Mamba-2's
    ``MAMBA2_KEYS`` and the hybrids'), the dt limits as ``time_step_limit``."""
    out = {theirs: getattr(s, ours) for ours, theirs in keys.items()}
    top = INFINITY if s.dt_limit_max is None else s.dt_limit_max
    return {**out, "time_step_limit": [s.dt_limit_min, top]}
