"""config.json writers, one per family export-hf supports: a ``ModelConfig`` -> the dict the
family's translator (``attnlab.pretrained.configs``) reads back as that config. A writer
may write what its family cannot express; ``export.hf_config_of`` keeps it only when the
config read back computes the same model."""

from __future__ import annotations

from attnlab.config import ModelConfig
from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.hf_hybrid import BAMBA_MAMBA_KEYS
from attnlab.pretrained.hf_ssm import MAMBA2_KEYS

# attnlab gated FFN kinds -> Hugging Face activation names.
_ACT = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}


def _base(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
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
        "rope_parameters": _rope_parameters(cfg),
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


def _rope_parameters(cfg: ModelConfig) -> dict:
    out = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    if s is not None:
        out = {**out, "rope_type": s.kind, "factor": s.factor}
        for name in _READS[s.kind]:
            value = getattr(s, name)
            if value is not None:
                out[_SCALING_KEYS[name]] = list(value) if isinstance(value, tuple) else value
    return out


def _windows(cfg: ModelConfig) -> dict:
    """``layer_types`` and ``sliding_window`` of the per-layer windows (one window size)."""
    windows = cfg.layer_windows(cfg.n_layers)
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"windows {windows}: a family's layers share one window size")
    types = ["full_attention" if w is None else "sliding_attention" for w in windows]
    # transformers wants a window even when no layer slides; then it is never used.
    return {"sliding_window": sizes.pop() if sizes else cfg.max_len, "layer_types": types}


def llama(cfg):
    return _base(cfg, "llama", "LlamaForCausalLM")


def qwen3(cfg):
    return _base(cfg, "qwen3", "Qwen3ForCausalLM")


def mistral(cfg):
    windows = set(cfg.layer_windows(cfg.n_layers))
    if len(windows) > 1:
        raise ValueError(f"windows {sorted(windows, key=str)}: Mistral slides in every layer")
    return {**_base(cfg, "mistral", "MistralForCausalLM"), "sliding_window": windows.pop()}


def olmo2(cfg):
    return _base(cfg, "olmo2", "Olmo2ForCausalLM")


def phi3(cfg):
    out = _base(cfg, "phi3", "Phi3ForCausalLM")
    del out["head_dim"], out["attention_bias"]
    if cfg.rotary_dim is not None:
        out["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    if cfg.rope_scaling is not None and cfg.rope_scaling.original_max_len is not None:
        # transformers' Phi-3 reads this top-level field over rope_parameters' own.
        out["original_max_position_embeddings"] = cfg.rope_scaling.original_max_len
    return out


def _gemma(cfg, model_type, architecture):
    out = _base(cfg, model_type, architecture)
    out["hidden_activation"] = out.pop("hidden_act")
    scale = cfg.attn_scale**-2
    out["query_pre_attn_scalar"] = round(scale) if abs(scale - round(scale)) < 1e-6 else scale
    return out


def gemma(cfg):
    return _gemma(cfg, "gemma", "GemmaForCausalLM")


def gemma2(cfg):
    out = {**_gemma(cfg, "gemma2", "Gemma2ForCausalLM"), **_windows(cfg)}
    out["attn_logit_softcapping"] = getattr(cfg.mixer_settings, "softcap", None)
    out["final_logit_softcapping"] = cfg.logits_softcap
    return out


def gemma3_text(cfg):
    out = {**_gemma(cfg, "gemma3_text", "Gemma3ForCausalLM"), **_windows(cfg)}
    thetas = cfg.layer_rope_thetas(cfg.n_layers)
    kinds = out["layer_types"]
    by_kind = {k: {t for t, kk in zip(thetas, kinds, strict=True) if kk == k} for k in set(kinds)}
    if any(len(v) > 1 for v in by_kind.values()):
        raise ValueError("Gemma 3 has one RoPE base per layer type")
    full = by_kind.get("full_attention", {cfg.rope_theta}).pop()
    local = by_kind.get("sliding_attention", {cfg.rope_theta}).pop()
    out["rope_parameters"] = {
        "full_attention": {**_rope_parameters(cfg), "rope_theta": full},
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }
    return out


def _experts(cfg, **fixed) -> dict:
    """The expert fields shared by Mixtral and Qwen3-MoE (ffn_variant "moe" only)."""
    s = cfg.ffn_settings
    if getattr(cfg, "ffn_variant", "dense") != "moe":
        raise ValueError("ffn_variant is not 'moe'")
    return {"num_local_experts": s.n_experts, "num_experts_per_tok": s.top_k, **fixed}


def mixtral(cfg):
    experts = _experts(cfg)
    windows = set(cfg.layer_windows(cfg.n_layers))
    if len(windows) > 1:
        raise ValueError(f"windows {sorted(windows, key=str)}: Mixtral slides in every layer")
    out = {**_base(cfg, "mixtral", "MixtralForCausalLM"), "sliding_window": windows.pop()}
    out["intermediate_size"] = cfg.ffn_settings.d_expert or cfg.d_ff
    return {**out, **experts}


def qwen3_moe(cfg):
    """Experts in every layer but those whose FFN is dense (``mlp_only_layers``)."""
    _experts(cfg)
    out = _base(cfg, "qwen3_moe", "Qwen3MoeForCausalLM")
    d_expert = cfg.ffn_settings.d_expert or cfg.d_ff
    kinds = stack_plan(cfg, cfg.n_layers).kinds
    return {
        **out,
        **_experts(
            cfg, moe_intermediate_size=d_expert, norm_topk_prob=cfg.ffn_settings.renormalize
        ),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, k in enumerate(kinds) if k.ffn_variant == "dense"],
    }


def gpt_oss(cfg):
    if cfg.mixer != "sinks":
        raise ValueError(f"mixer={cfg.mixer!r}: gpt-oss attends with sinks")
    s = cfg.ffn_settings
    out = {**_base(cfg, "gpt_oss", "GptOssForCausalLM"), **_windows(cfg), **_experts(cfg)}
    out["intermediate_size"] = s.d_expert or cfg.d_ff
    out["swiglu_limit"] = s.swiglu_limit
    out["swiglu_alpha"] = s.swiglu_alpha
    out["router_aux_loss_coef"] = s.load_balance_weight
    return out


def deepseek_v3(cfg):
    """MLA (its settings resolved) and experts after the dense first layers; RoPE dims are
    written in attnlab's half-split layout (``rope_interleave`` false)."""
    if cfg.mixer != "mla":
        raise ValueError(f"mixer={cfg.mixer!r}: DeepSeek-V3 attends with mla")
    m, s = cfg.mixer_settings.resolved(cfg), cfg.ffn_settings
    out = {**_base(cfg, "deepseek_v3", "DeepseekV3ForCausalLM"), **_experts(cfg)}
    del out["head_dim"], out["num_local_experts"]
    out.update(
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=False,
        n_routed_experts=s.n_experts,
        moe_intermediate_size=s.d_expert or cfg.d_ff,
        n_group=s.n_group,
        topk_group=s.topk_group,
        n_shared_experts=s.n_shared,
        first_k_dense_replace=s.dense_layers,
        routed_scaling_factor=s.routed_scaling,
        norm_topk_prob=s.renormalize,
    )
    return out


# attnlab mixers -> Qwen3-Next's layer types (the gate must be elementwise: read back).
_QWEN3_NEXT_TYPES = {"gated_deltanet": "linear_attention", "gated": "full_attention"}


def _single_mixers(cfg, family: str, names: dict) -> list:
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


def qwen3_next(cfg):
    """Gated DeltaNet and gated attention layers (``layer_types`` per layer, the DeltaNet
    settings of the first such layer), every FFN experts with one gated shared expert."""
    mixers = _single_mixers(cfg, "Qwen3-Next", _QWEN3_NEXT_TYPES)
    s = cfg.ffn_settings
    if getattr(cfg, "ffn_variant", None) != "moe" or s.n_shared != 1 or not s.shared_gate:
        raise ValueError("ffn_settings: Qwen3-Next's FFN is experts with one gated shared expert")
    out = _base(cfg, "qwen3_next", "Qwen3NextForCausalLM")
    if cfg.rotary_dim is not None:
        out["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    out["layer_types"] = [_QWEN3_NEXT_TYPES[m.mixer] for m in mixers]
    linear = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "gated_deltanet"]
    if linear:
        g = linear[0]
        out.update(
            linear_num_value_heads=g.num_v_heads,
            linear_num_key_heads=g.num_k_heads,
            linear_key_head_dim=g.head_k_dim,
            linear_value_head_dim=g.head_v_dim,
            linear_conv_kernel_dim=g.conv_kernel,
        )
    d_expert = s.d_expert or cfg.d_ff
    out.update(
        num_experts=s.n_experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=d_expert,
        shared_expert_intermediate_size=s.d_shared or d_expert,
        norm_topk_prob=s.renormalize,
        router_aux_loss_coef=s.load_balance_weight,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return out


_INFINITY = {"__float__": "Infinity"}  # as transformers 5 writes it


def _mamba2_keys(s, keys: dict) -> dict:
    """Resolved ``mamba2`` settings ``s`` under config.json ``keys`` (``hf_ssm.MAMBA2_KEYS``
    and the hybrids'), the dt limits as ``time_step_limit``."""
    out = {theirs: getattr(s, ours) for ours, theirs in keys.items()}
    top = _INFINITY if s.dt_limit_max is None else s.dt_limit_max
    return {**out, "time_step_limit": [s.dt_limit_min, top]}


def mamba2(cfg):
    """Every layer one ``mamba2`` mixer with no FFN (``ffn_variant="none"``)."""
    mixers = _single_mixers(cfg, "Mamba-2", {"mamba2": None})
    if any(k.ffn_variant != "none" for k in stack_plan(cfg, cfg.n_layers).kinds):
        raise ValueError("ffn_variant: Mamba-2's layers have no FFN ('none')")
    if cfg.arch != "decoder":
        raise ValueError(f"arch={cfg.arch!r}: export-hf writes decoder-only models")
    s = mixers[0].mixer_settings.resolved(cfg)
    return {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        **_mamba2_keys(s, MAMBA2_KEYS),
        "time_step_min": s.time_step_min,
        "time_step_max": s.time_step_max,
        "time_step_floor": s.time_step_floor,
        "layer_norm_epsilon": cfg.norm_eps,
        "hidden_act": "silu",
        "rms_norm": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_id,
        "dtype": "float32",
    }


def bamba(cfg):
    """Mamba-2 and attention layers (``attn_layer_indices``), each with a SwiGLU FFN; the
    Mamba-2 settings of the first such layer."""
    mixers = _single_mixers(cfg, "Bamba", {"mamba2": None, "mha": None})
    out = _base(cfg, "bamba", "BambaForCausalLM")
    del out["head_dim"]  # BambaConfig has none: d_model / n_heads
    out["mlp_bias"] = False
    out["rope_parameters"]["partial_rotary_factor"] = (
        cfg.rotary_dim or cfg.head_dim
    ) / cfg.head_dim
    out["attn_layer_indices"] = [i for i, m in enumerate(mixers) if m.mixer == "mha"]
    mamba = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "mamba2"]
    if mamba:
        out.update(_mamba2_keys(mamba[0], BAMBA_MAMBA_KEYS))
    return out


WRITERS = {
    "llama": llama,
    "qwen3": qwen3,
    "mistral": mistral,
    "olmo2": olmo2,
    "phi3": phi3,
    "gemma": gemma,
    "gemma2": gemma2,
    "gemma3_text": gemma3_text,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "gpt_oss": gpt_oss,
    "deepseek_v3": deepseek_v3,
    "qwen3_next": qwen3_next,
    "mamba2": mamba2,
    "bamba": bamba,
}
