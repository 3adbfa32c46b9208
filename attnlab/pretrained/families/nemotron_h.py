"""Nemotron-H checkpoints that transformers writes (``NemotronHForCausalLM``): the config.json
translator, the renaming of its layers into attnlab blocks and the tensor-name table.

Nemotron-H's layers hold one sub-layer each (Mamba-2, attention without positions, or a
squared-ReLU MLP); a mixer layer and the MLP layer after it are one attnlab block, a mixer
without one a block with ``ffn_variant="none"``, and the blocks' kinds become a
``block_pattern`` as Bamba's (``hf_base.prefix_and_block``). ``nemotron_h_units`` (the family's
``prepare``) renames the stored layers to those blocks before the table applies.
"""

from __future__ import annotations

import numpy as np

from attnlab.pretrained.families.bamba import HYBRID_DEFAULTS, with_defaults
from attnlab.pretrained.families.mamba2 import MAMBA2_KEYS, mamba2_rows, mamba2_settings
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    decoder_fields,
    ffn_kind,
    prefix_and_block,
    reject,
    require,
)
from attnlab.pretrained.mappings import Mapping, linear_attention, table

# transformers' defaults of the keys a config.json may leave out (where attnlab's differ).
_NEMOTRON_H_DEFAULTS = {
    **HYBRID_DEFAULTS, "head_dim": 128, "mamba_num_heads": 128, "n_groups": 8,
    "chunk_size": 128, "mlp_hidden_act": "relu2",
}  # fmt: skip
# NemotronHConfig's older key -> the one it reads now.
_NEMOTRON_H_RENAMED = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min", "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}  # fmt: skip


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
    c = with_defaults(c, _NEMOTRON_H_DEFAULTS, _NEMOTRON_H_RENAMED)
    reject(c, "mamba_hidden_act", lambda v: v not in (None, "silu"), "Mamba-2 gates with silu")
    reject(c, "mlp_bias", (True,), "attnlab's Nemotron-H MLP has no biases")
    reject(c, "sliding_window", lambda v: v is not None, "Nemotron-H attends to every token")
    settings = mamba2_settings(c, NEMOTRON_MAMBA_KEYS)
    settings["d_inner"] = settings["num_heads"] * settings["head_dim"]
    settings["dt_limit_min"] = float(c.get("time_step_min", 0.001))  # transformers' own limit
    settings["dt_limit_max"] = None
    mamba = {"mixer": "mamba2", "mixer_settings": settings}
    kinds = []
    for kind, _, mlp in _nemotron_units(c):
        kind = mamba if kind == "linear_attention" else {"mixer": "mha"}
        kinds.append(kind if mlp is not None else {**kind, "ffn_variant": "none"})
    return decoder_fields(
        c,
        n_layers=len(kinds),
        max_len=c.get("max_position_embeddings") or 4096,
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        ffn=ffn_kind(c, "mlp_hidden_act", "relu2", gated=False),
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
_A = "decoder.layers.{i}"
NEMOTRON_H = Mapping(
    rules=table(
        ("backbone.embeddings.weight", "embed.tokens.embedding_VD"),
        ("backbone.norm_f.weight", "decoder.final_norm.scale_D"),
        ("lm_head.weight", "head.head_DV", "linear"),
        (f"{_U}.attn_norm.weight", f"{_A}.attn_norm.scale_D"),
        (f"{_U}.ffn_norm.weight", f"{_A}.ffn_norm.scale_D"),
        mamba2_rows(f"{_U}.mixer", f"{_A}.attn"),
        linear_attention(f"{_U}.mixer", f"{_A}.attn", bias=False),
        (f"{_U}.mlp.up_proj.weight", f"{_A}.ffn.w_in_DF", "linear"),
        (f"{_U}.mlp.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
    ),
    ignore=("lm_head.weight",),
)


register_family(
    Family(
        "nemotron_h",
        config=nemotron_h,
        mapping=NEMOTRON_H,
        prepare=nemotron_h_units,
        architectures=("NemotronH",),
    )
)
