"""Bamba (``BambaForCausalLM``), the Mamba-2 hybrid that transformers writes, and the pieces
Falcon-H1 and Nemotron-H share with it (their config.json defaults, the Mamba-2 keys).

Bamba's layers are each ``x + mixer(norm(x))`` then ``x + SwiGLU(norm(x))``; the mixer is
Mamba-2 (attnlab's ``mamba2``, parameters in transformers' layout, its gated RMSNorm per
group of ``mamba_n_groups``) except at ``attn_layer_indices``, where it is Llama's attention
(``mha``) with RoPE on ``partial_rotary_factor`` of each head (0.5 when config.json does not
say, as transformers hard-codes it). The layer kinds become a ``block_pattern`` (a block
repeated after a prefix, ``hf_base.prefix_and_block``), so ``[M, A, M, A]`` scans one block
``[M, A]`` twice and an irregular placement loads with its start unrolled as the prefix.
"""

from __future__ import annotations

from attnlab.pretrained.export_configs import base_config, mamba2_keys, single_mixers
from attnlab.pretrained.families.mamba2 import mamba2_rows, mamba2_settings
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    prefix_and_block,
    reject,
    require,
    rope_decoder_fields,
)
from attnlab.pretrained.mappings import (
    A,
    L,
    Mapping,
    ends,
    gated_ffn,
    layer_rows,
    linear_attention,
    table,
)

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


# transformers' defaults of the keys a config.json may leave out (where attnlab's differ).
HYBRID_DEFAULTS = {"num_key_value_heads": 8}
_BAMBA_DEFAULTS = {
    **HYBRID_DEFAULTS, "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_d_state": 256,
    "mamba_chunk_size": 256, "max_position_embeddings": 262144,
}  # fmt: skip
FALCON_H1_DEFAULTS = {**_BAMBA_DEFAULTS, "mamba_d_ssm": 1024, "max_position_embeddings": 8192}


def with_defaults(c: dict, defaults: dict, renamed: dict | None = None) -> dict:
    """``c`` with ``defaults`` where it leaves a key out, older keys read as ``renamed``."""
    renamed = {new: c[old] for old, new in (renamed or {}).items() if old in c}
    return {**defaults, **c, **renamed}


def bamba_mamba(c: dict) -> dict:
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
    c = with_defaults(c, _BAMBA_DEFAULTS)
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Bamba's Mamba-2 gates with silu")
    reject(c, "mlp_bias", (True,), "attnlab's gated FFN has no bias on its gate")
    n = require(c, "num_hidden_layers")
    attention = _attention_layers(c, n)
    mamba = bamba_mamba(c)
    kinds = [{"mixer": "mha"} if i in attention else mamba for i in range(n)]
    params = c.get("rope_parameters") or {}
    bias = bool(c.get("attention_bias", False))
    return rope_decoder_fields(
        c,
        rotary={"rope_parameters": {"partial_rotary_factor": 0.5, **params}},
        norm_eps=c.get("rms_norm_eps", 1e-5),
        attn_bias=bias,
        out_bias=bias,
        block_pattern=prefix_and_block(kinds),
    )


def decoder_table(*mixer_rows):
    """The rows of a decoder whose layers keep Llama's names around their mixer's rows (the
    embedding, the norms, the SwiGLU FFN and the head), shared by Bamba and Falcon-H1."""
    return table(
        ends(norm="model.final_layernorm"),
        layer_rows(ffn_norm="pre_ff_layernorm"),
        *mixer_rows,
        gated_ffn(f"{L}.feed_forward"),
    )


def decoder_mapping(*mixer_rows) -> Mapping:
    """``decoder_table``'s rows under ``model.``, a tied head's copy ignored."""
    return Mapping(prefix="model.", rules=decoder_table(*mixer_rows), ignore=("lm_head.weight",))


BAMBA = decoder_mapping(
    mamba2_rows(f"{L}.mamba", f"{A}.attn"), linear_attention(f"{L}.self_attn", f"{A}.attn")
)


def bamba_writer(cfg):
    """Mamba-2 and attention layers (``attn_layer_indices``), each with a SwiGLU FFN; the
    Mamba-2 settings of the first such layer."""
    mixers = single_mixers(cfg, "Bamba", {"mamba2": None, "mha": None})
    out = base_config(cfg, "bamba", "BambaForCausalLM")
    del out["head_dim"]  # BambaConfig has none: d_model / n_heads
    out["mlp_bias"] = False
    out["rope_parameters"]["partial_rotary_factor"] = (
        cfg.rotary_dim or cfg.head_dim
    ) / cfg.head_dim
    out["attn_layer_indices"] = [i for i, m in enumerate(mixers) if m.mixer == "mha"]
    mamba = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "mamba2"]
    if mamba:
        out.update(mamba2_keys(mamba[0], BAMBA_MAMBA_KEYS))
    return out


register_family(
    Family("bamba", config=bamba, mapping=BAMBA, write=bamba_writer, architectures=("Bamba",))
)
