"""Apertus: a Llama-shaped decoder with QK-norm per head and a plain (ungated) FFN whose
activation is xIELU (``ffn="xielu"``: two learned scalars per layer, ``act_alpha_p`` and
``act_alpha_n``); its norms are named ``attention_layernorm`` and ``feedforward_layernorm``.
xIELU's ``beta`` (0.5) and ``eps`` (-1e-6) are buffers of the checkpoint that transformers
fixes: other values are refused."""

from __future__ import annotations

import numpy as np

from attnlab.pretrained.export_configs import base_config
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import UnsupportedCheckpointError, ffn_kind
from attnlab.pretrained.mappings import A, L, layer_rows, llama_mapping, self_attention


def apertus(c: dict) -> dict:
    return llama_like(c, qk_norm=True, ffn=ffn_kind(c, "hidden_act", "xielu", gated=False))


_FIXED = {"beta": 0.5, "eps": -1e-6}


def xielu_buffers(tensors: dict, c: dict) -> dict:
    """Drops xIELU's fixed ``beta`` and ``eps`` buffers after checking their values."""
    out = {}
    for name, x in tensors.items():
        key = name.rsplit(".", 1)[-1]
        if not name.endswith((".act_fn.beta", ".act_fn.eps")):
            out[name] = x
            continue
        if not np.isclose(float(np.asarray(x, np.float32)), _FIXED[key], rtol=1e-3, atol=0):
            raise UnsupportedCheckpointError(
                f"tensor {name!r}={float(x)} is not supported: attnlab's xIELU has "
                f"{key}={_FIXED[key]} (transformers' value)"
            )
    return out


APERTUS = llama_mapping(
    layer_rows(
        self_attention(qk_norm=True),
        attn_norm="attention_layernorm",
        ffn_norm="feedforward_layernorm",
    ),
    (f"{L}.mlp.up_proj.weight", f"{A}.ffn.w_in_DF", "linear"),
    (f"{L}.mlp.down_proj.weight", f"{A}.ffn.w_out_FD", "linear"),
    (f"{L}.mlp.act_fn.alpha_p", f"{A}.ffn.act_alpha_p", "scalar"),
    (f"{L}.mlp.act_fn.alpha_n", f"{A}.ffn.act_alpha_n", "scalar"),
)


def with_xielu_buffers(tensors: dict, c: dict) -> dict:
    """The export's tensors with xIELU's fixed buffers, which transformers reads."""
    out = dict(tensors)
    for i in range(c["num_hidden_layers"]):
        for key, value in _FIXED.items():
            out[f"model.layers.{i}.mlp.act_fn.{key}"] = np.asarray(value, np.float32)
    return out


def apertus_writer(cfg):
    return base_config(cfg, "apertus", "ApertusForCausalLM")


register_family(
    Family(
        "apertus",
        config=apertus,
        mapping=APERTUS,
        write=apertus_writer,
        prepare=xielu_buffers,
        finish=with_xielu_buffers,
        architectures=("Apertus",),
    )
)
