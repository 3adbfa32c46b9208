"""Mamba-2 hybrids that transformers writes: Bamba (``BambaForCausalLM``), Falcon-H1
(``FalconH1ForCausalLM``) and Nemotron-H (``NemotronHForCausalLM``), their config.json
translators and tensor-name tables.

Bamba's layers are each ``x + mixer(norm(x))`` then ``x + SwiGLU(norm(x))``; the mixer is
Mamba-2 (attnlab's ``mamba2``, parameters in transformers' layout, its gated RMSNorm per
group of ``mamba_n_groups``) except at ``attn_layer_indices``, where it is Llama's attention
(``mha``) with RoPE on ``partial_rotary_factor`` of each head (0.5 when config.json does not
say, as transformers hard-codes it). The layer kinds become a ``block_pattern`` (a block
repeated after a prefix, ``hf_base.prefix_and_block``), so ``[M, A, M, A]`` scans one block
``[M, A]`` twice and an irregular placement loads with its start unrolled as the prefix.

Falcon-H1's every layer runs attention (``mha``) and Mamba-2 side by side on the same normed
input, their outputs summed (one layer kind of two mixers), then a SwiGLU FFN. Its Mamba-2
has an inner width of its own (``mamba_d_ssm``: the mixer's ``d_inner``) and gates without
a norm unless ``mamba_rms_norm``. Its muP multipliers scale projections' inputs and outputs;
``falcon_h1_multipliers`` folds each into the stored weights before the table applies (the
loader's ``PREPARE`` step), so the model computes with no multiplier of its own but a tied
head's ``logits_scale``.

Nemotron-H's layers hold one sub-layer each (Mamba-2, attention without positions, or a
squared-ReLU MLP); a mixer layer and the MLP layer after it are one attnlab block, a mixer
without one a block with ``ffn_variant="none"``. ``nemotron_h_units`` renames the stored
layers to those blocks before the table applies.
"""

from __future__ import annotations

import numpy as np

from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    common_fields,
    ffn_kind,
    prefix_and_block,
    reject,
    require,
    rope_scaling_of,
    rope_theta_of,
    rotary_fraction,
)
from attnlab.pretrained.hf_ssm import MAMBA2_KEYS, mamba2_rows, mamba2_settings
from attnlab.pretrained.mappings import Mapping, _linear_attention, _table

# BambaConfig's (and FalconH1Config's) key of each ``mamba2`` setting.
BAMBA_MAMBA_KEYS = {
    "expand": "mamba_expand",
    "head_dim": "mamba_d_head",
    "num_heads": "mamba_n_heads",
    "state_size": "mamba_d_state",
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "chunk_size": "mamba_chunk_size",
    "use_conv_bias": "mamba_conv_bias",
    "use_bias": "mamba_proj_bias",
}


def _bamba_mamba(c: dict) -> dict:
    D = require(c, "hidden_size")
    settings = mamba2_settings(c, BAMBA_MAMBA_KEYS)
    if settings["head_dim"] in (None, "auto"):  # transformers derives it
        settings["head_dim"] = settings["expand"] * D // settings["num_heads"]
    return {"mixer": "mamba2", "mixer_settings": settings}


def _attention_layers(c: dict, n: int) -> set:
    indices = c.get("attn_layer_indices") or []
    if any(not isinstance(i, int) or not 0 <= i < n for i in indices):
        raise UnsupportedCheckpointError(
            f"config.json attn_layer_indices={indices!r} is not supported: give layer indices "
            f"in [0, num_hidden_layers={n})"
        )
    return set(indices)


def bamba(c: dict) -> dict:
    """``BambaConfig`` -> a hybrid decoder of Mamba-2 and attention layers, each with a
    SwiGLU FFN."""
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Bamba's Mamba-2 gates with silu")
    reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    D, N = require(c, "hidden_size"), require(c, "num_attention_heads")
    H = c.get("head_dim") or D // N
    n = require(c, "num_hidden_layers")
    attention = _attention_layers(c, n)
    mamba = _bamba_mamba(c)
    kinds = [{"mixer": "mha"} if i in attention else mamba for i in range(n)]
    params = c.get("rope_parameters") or {}
    fraction = rotary_fraction({**c, "rope_parameters": {"partial_rotary_factor": 0.5, **params}})
    bias = bool(c.get("attention_bias", False))
    return common_fields(
        c,
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=D,
        n_layers=n,
        n_heads=N,
        n_kv_heads=c.get("num_key_value_heads") or N,
        head_dim=H,
        d_ff=require(c, "intermediate_size"),
        max_len=c.get("max_position_embeddings") or 2048,
        position="rope",
        rope_theta=rope_theta_of(c, partial=True, scaled=True),
        rope_scaling=rope_scaling_of(c),
        rotary_dim=None if fraction == 1.0 else int(H * fraction),
        norm="rmsnorm",
        norm_eps=c.get("rms_norm_eps", 1e-5),
        norm_placement="pre",
        ffn=ffn_kind(c, "hidden_act", "silu", gated=True),
        attn_bias=bias,
        out_bias=bias,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        block_pattern=prefix_and_block(kinds),
    )


_L = "model.layers.{i}"
_A = "decoder.layers.{i}"
BAMBA = Mapping(
    prefix="model.",
    rules=_table(
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        ("model.final_layernorm.weight", "decoder.final_norm.scale_D"),
        ("lm_head.weight", "head.head_DV", "linear"),
        (f"{_L}.input_layernorm.weight", f"{_A}.attn_norm.scale_D"),
        (f"{_L}.pre_ff_layernorm.weight", f"{_A}.ffn_norm.scale_D"),
        mamba2_rows(f"{_L}.mamba", f"{_A}.attn"),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn"),
        (f"{_L}.feed_forward.gate_proj.weight", f"{_A}.ffn.w_gate_DF", "linear"),
        (f"{_L}.feed_forward.up_proj.weight", f"{_A}.ffn.w_in_DF", "linear"),
        (f"{_L}.feed_forward.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
    ),
    ignore=("lm_head.weight",),
)


def falcon_h1(c: dict) -> dict:
    """``FalconH1Config`` -> a decoder whose every layer runs attention and Mamba-2 side by
    side on the same normed input (their outputs summed), then a SwiGLU FFN. The muP
    multipliers are folded into the weights on load (``falcon_h1_multipliers``); the output
    head's is ``logits_scale`` when the head is tied to the embeddings."""
    reject(
        c, "hidden_act", lambda v: v not in (None, "silu"), "Falcon-H1's Mamba-2 gates with silu"
    )
    reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    if bool(c.get("mamba_proj_bias", False)) != bool(c.get("projectors_bias", False)):
        raise UnsupportedCheckpointError(
            f"config.json mamba_proj_bias={c.get('mamba_proj_bias')!r} with projectors_bias="
            f"{c.get('projectors_bias')!r} is not supported: attnlab's Mamba-2 has biases on "
            "both its projections or neither; set them equal"
        )
    D, N = require(c, "hidden_size"), require(c, "num_attention_heads")
    mamba = _bamba_mamba(c)
    settings = mamba["mixer_settings"]
    settings["d_inner"] = c.get("mamba_d_ssm") or settings["expand"] * D
    if settings["head_dim"] * settings["num_heads"] != settings["d_inner"]:  # "auto" above
        settings["head_dim"] = settings["d_inner"] // settings["num_heads"]
    if not c.get("mamba_rms_norm", False):
        settings["norm"] = "none"
    elif c.get("mamba_norm_before_gate", True):
        settings["norm"] = "norm_then_gate"
    tied = bool(c.get("tie_word_embeddings", False))
    head = float(c.get("lm_head_multiplier", 1.0))
    bias = bool(c.get("attention_bias", False))
    return common_fields(
        c,
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=D,
        n_layers=require(c, "num_hidden_layers"),
        n_heads=N,
        n_kv_heads=c.get("num_key_value_heads") or N,
        head_dim=c.get("head_dim") or D // N,
        d_ff=require(c, "intermediate_size"),
        max_len=c.get("max_position_embeddings") or 8192,
        position="rope",
        rope_theta=rope_theta_of(c, scaled=True),
        rope_scaling=rope_scaling_of(c),
        norm="rmsnorm",
        norm_eps=c.get("rms_norm_eps", 1e-5),
        norm_placement="pre",
        ffn=ffn_kind(c, "hidden_act", "silu", gated=True),
        attn_bias=bias,
        out_bias=bias,
        tie_embeddings=tied,
        logits_scale=head / float(c.get("embedding_multiplier", 1.0)) if tied else 1.0,
        block_pattern={"block": [{"mixers": ["mha", mamba]}]},
    )


def _scaled(tensors: dict, name: str, factor) -> None:
    if name in tensors and not (isinstance(factor, float) and factor == 1.0):
        tensors[name] = (tensors[name].astype(np.float32) * factor).astype(tensors[name].dtype)


def _mup_rows(c: dict) -> np.ndarray:
    """Falcon-H1's ``mup_vector``: one multiplier per row of ``in_proj`` (z, x, B, C, dt)."""
    D = require(c, "hidden_size")
    inner = c.get("mamba_d_ssm") or c.get("mamba_expand", 2) * D
    gj = c.get("mamba_n_groups", 1) * c.get("mamba_d_state", 256)
    sizes = (inner, inner, gj, gj, require(c, "mamba_n_heads"))
    m = [float(v) for v in c.get("ssm_multipliers") or (1.0,) * 5]
    return np.concatenate([np.full(n, v, np.float32) for n, v in zip(sizes, m, strict=True)])


def falcon_h1_multipliers(tensors: dict, c: dict) -> dict:
    """The muP multipliers of Falcon-H1's forward folded into the stored weights, each where
    transformers multiplies: a projection's output (rows and bias) or input (weight only)."""
    out = dict(tensors)
    f = lambda key: float(c.get(key, 1.0))
    _scaled(out, "model.embed_tokens.weight", f("embedding_multiplier"))
    if not c.get("tie_word_embeddings", False):
        _scaled(out, "lm_head.weight", f("lm_head_multiplier"))
    gate, down = (float(v) for v in c.get("mlp_multipliers") or (1.0, 1.0))
    mup = _mup_rows(c)
    n = require(c, "num_hidden_layers")
    for i in range(n):
        L = f"model.layers.{i}"
        _scaled(out, f"{L}.mamba.in_proj.weight", (mup * f("ssm_in_multiplier"))[:, None])
        _scaled(out, f"{L}.mamba.in_proj.bias", mup)
        for w in ("weight", "bias"):
            _scaled(out, f"{L}.mamba.out_proj.{w}", f("ssm_out_multiplier"))
            _scaled(out, f"{L}.self_attn.k_proj.{w}", f("key_multiplier"))
            _scaled(out, f"{L}.self_attn.o_proj.{w}", f("attention_out_multiplier"))
            _scaled(out, f"{L}.feed_forward.gate_proj.{w}", gate)
            _scaled(out, f"{L}.feed_forward.down_proj.{w}", down)
        for p in ("q_proj", "k_proj", "v_proj"):
            _scaled(out, f"{L}.self_attn.{p}.weight", f("attention_in_multiplier"))
    return out


_P = f"{_A}.attn"
FALCON_H1 = Mapping(
    prefix="model.",
    rules=_table(
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        ("model.final_layernorm.weight", "decoder.final_norm.scale_D"),
        ("lm_head.weight", "head.head_DV", "linear"),
        (f"{_L}.input_layernorm.weight", f"{_A}.attn_norm.scale_D"),
        (f"{_L}.pre_ff_layernorm.weight", f"{_A}.ffn_norm.scale_D"),
        _linear_attention(f"{_L}.self_attn", f"{_P}.0"),
        mamba2_rows(f"{_L}.mamba", f"{_P}.1"),
        (f"{_L}.feed_forward.gate_proj.weight", f"{_A}.ffn.w_gate_DF", "linear"),
        (f"{_L}.feed_forward.up_proj.weight", f"{_A}.ffn.w_in_DF", "linear"),
        (f"{_L}.feed_forward.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
    ),
    ignore=("lm_head.weight",),
)


# Nemotron-H's layer types -> attnlab mixers (its "mlp" layers become FFNs; "moe" is refused).
_NEMOTRON_MIXERS = ("linear_attention", "full_attention")


# NemotronHConfig's key of each ``mamba2`` setting.
NEMOTRON_MAMBA_KEYS = {
    **MAMBA2_KEYS,
    "head_dim": "mamba_head_dim",
    "num_heads": "mamba_num_heads",
    "state_size": "ssm_state_size",
}


def _nemotron_types(c: dict) -> list[str]:
    """``layers_block_type`` (older files: the letters of ``hybrid_override_pattern``)."""
    types = c.get("layers_block_type") or c.get("layer_types")
    if types is None and isinstance(c.get("hybrid_override_pattern"), str):
        letters = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
        types = [letters.get(t, t) for t in c["hybrid_override_pattern"]]
    return list(require({"layers_block_type": types}, "layers_block_type"))


def _nemotron_units(c: dict) -> list[tuple[str, int, int | None]]:
    """Nemotron-H's one-sub-layer layers paired into attnlab blocks: ``(mixer type, its
    layer, the "mlp" layer right after it or None)``."""
    types, units, i = _nemotron_types(c), [], 0
    while i < len(types):
        if types[i] not in _NEMOTRON_MIXERS:
            raise UnsupportedCheckpointError(
                f"config.json layers_block_type[{i}]={types[i]!r} is not supported: attnlab "
                f"loads {list(_NEMOTRON_MIXERS)} layers, each followed by at most one 'mlp'"
            )
        mlp = i + 1 if i + 1 < len(types) and types[i + 1] == "mlp" else None
        units.append((types[i], i, mlp))
        i += 2 if mlp is not None else 1
    return units


def nemotron_h(c: dict) -> dict:
    """``NemotronHConfig`` -> a decoder of Mamba-2 and attention layers without positions,
    each Mamba-2 or attention layer and the ``mlp`` layer after it (squared-ReLU FFN) one
    attnlab block; a mixer with no ``mlp`` after it has no FFN (``ffn_variant="none"``)."""
    reject(c, "mamba_hidden_act", lambda v: v not in (None, "silu"), "Mamba-2 gates with silu")
    reject(c, "mlp_bias", (True,), "attnlab's Nemotron-H MLP has no biases")
    reject(c, "sliding_window", lambda v: v is not None, "Nemotron-H attends to every token")
    D, N = require(c, "hidden_size"), require(c, "num_attention_heads")
    settings = mamba2_settings(c, NEMOTRON_MAMBA_KEYS)
    settings["d_inner"] = settings["num_heads"] * settings["head_dim"]
    settings["dt_limit_min"] = float(c.get("time_step_min", 0.001))  # transformers' own limit
    settings["dt_limit_max"] = None
    mamba = {"mixer": "mamba2", "mixer_settings": settings}
    kinds = []
    for kind, _, mlp in _nemotron_units(c):
        kind = mamba if kind == "linear_attention" else {"mixer": "mha"}
        kinds.append(kind if mlp is not None else {**kind, "ffn_variant": "none"})
    return common_fields(
        c,
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=D,
        n_layers=len(kinds),
        n_heads=N,
        n_kv_heads=c.get("num_key_value_heads") or N,
        head_dim=c.get("head_dim") or D // N,
        d_ff=require(c, "intermediate_size"),
        max_len=c.get("max_position_embeddings") or 4096,
        position="none",
        norm="rmsnorm",
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        norm_placement="pre",
        ffn=ffn_kind(c, "mlp_hidden_act", "relu2", gated=False),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        block_pattern=prefix_and_block(kinds),
    )


def _backbone(name: str) -> str:
    """A Nemotron-H tensor name under ``backbone.`` (files write it; transformers' modules
    say ``model.``; a bare base model says neither)."""
    if name.startswith("lm_head."):
        return name
    return "backbone." + name.removeprefix("model.").removeprefix("backbone.")


def nemotron_h_units(tensors: dict, c: dict) -> dict:
    """Nemotron-H's layers renamed as attnlab's blocks (``_nemotron_units``):
    ``backbone.units.{i}.{attn_norm, mixer, ffn_norm, mlp}``; a block without an ``mlp``
    layer gets ones for the FFN norm it never reads."""
    tensors = {_backbone(k): v for k, v in tensors.items()}
    out = {k: v for k, v in tensors.items() if not k.startswith("backbone.layers.")}
    for i, (_, j, mlp) in enumerate(_nemotron_units(c)):
        for role, layer in (("attn_norm", j), ("ffn_norm", mlp)):
            norm = f"backbone.layers.{layer}.norm.weight"
            if layer is not None and norm in tensors:
                out[f"backbone.units.{i}.{role}.weight"] = tensors[norm]
        if mlp is None:
            D = require(c, "hidden_size")
            out[f"backbone.units.{i}.ffn_norm.weight"] = np.ones(D, np.float32)
        for name, x in tensors.items():
            for role, layer in (("mixer", j), ("mlp", mlp)):
                head = f"backbone.layers.{layer}.mixer."
                if layer is not None and name.startswith(head):
                    out[f"backbone.units.{i}.{role}.{name[len(head) :]}"] = x
    return out


_U = "backbone.units.{i}"
NEMOTRON_H = Mapping(
    rules=_table(
        ("backbone.embeddings.weight", "embed.tokens.embedding_VD"),
        ("backbone.norm_f.weight", "decoder.final_norm.scale_D"),
        ("lm_head.weight", "head.head_DV", "linear"),
        (f"{_U}.attn_norm.weight", f"{_A}.attn_norm.scale_D"),
        (f"{_U}.ffn_norm.weight", f"{_A}.ffn_norm.scale_D"),
        mamba2_rows(f"{_U}.mixer", f"{_A}.attn"),
        _linear_attention(f"{_U}.mixer", f"{_A}.attn", bias=False),
        (f"{_U}.mlp.up_proj.weight", f"{_A}.ffn.w_in_DF", "linear"),
        (f"{_U}.mlp.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
    ),
    ignore=("lm_head.weight",),
)
