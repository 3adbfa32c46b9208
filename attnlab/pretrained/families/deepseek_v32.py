"""DeepSeek-V3.2: DeepSeek-V3 (``deepseek_v3``) with DeepSeek Sparse Attention in every layer
(``mixer="dsa"``): a lightning indexer of ``index_n_heads`` heads of ``index_head_dim``
(its query from the compressed query, its LayerNorm-ed key from the layer's input, RoPE
in the half-split layout on its first ``qk_rope_head_dim`` values) picks ``index_topk``
keys per query for MLA. The main attention's RoPE dims are stored interleaved, always (no
``rope_interleave`` key): reordered on load and back on export."""

from __future__ import annotations

import numpy as np

from attnlab.pretrained.families.deepseek_v3 import (
    DEEPSEEK_V3,
    deepseek_rope_layout,
    deepseek_v3,
    deepseek_v3_writer,
)
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import reject, require
from attnlab.pretrained.mappings import A, L, Mapping, table


def deepseek_v32(c: dict) -> dict:
    """DeepSeek-V3's fields with MLA made sparse by the indexer's settings."""
    require(c, "q_lora_rank")  # the indexer's queries read the compressed query
    n, dense = c.get("num_hidden_layers"), c.get("first_k_dense_replace") or 0
    reject(
        c, "mlp_layer_types",
        lambda v: v is not None and list(v) != ["dense"] * dense + ["sparse"] * (n - dense),
        f"the first first_k_dense_replace={dense} layers dense and the rest sparse",
    )  # fmt: skip
    reject(
        c, "layer_types", lambda v: v is not None and set(v) != {"indexed_attention"},
        "every layer 'indexed_attention'",
    )  # fmt: skip
    fields = deepseek_v3({k: v for k, v in c.items() if k != "layer_types"})
    fields["mixer"] = "dsa"
    fields["mixer_settings"] = {
        **fields["mixer_settings"],
        "topk": require(c, "index_topk"),
        "index_heads": require(c, "index_n_heads"),
        "index_head_dim": require(c, "index_head_dim"),
        "index_norm_eps": 1e-6,
    }
    return fields


# DeepSeek-V3's table and the indexer's projections and key norm.
_M = f"{L}.self_attn.indexer"
DEEPSEEK_V32 = Mapping(
    prefix=DEEPSEEK_V3.prefix,
    rules=DEEPSEEK_V3.rules
    + table(
        (f"{_M}.wq_b.weight", f"{A}.attn.index_q_RNH", "linear_to_heads"),
        (f"{_M}.wk.weight", f"{A}.attn.index_k_DH", "linear"),
        (f"{_M}.k_norm.weight", f"{A}.attn.index_k_scale_H"),
        (f"{_M}.k_norm.bias", f"{A}.attn.index_k_bias_H"),
        (f"{_M}.weights_proj.weight", f"{A}.attn.index_w_DN", "linear"),
    ),
    ignore=DEEPSEEK_V3.ignore,
)


def _interleave(w, size, rope):
    """The inverse of ``deepseek_v3._deinterleave``: the last ``rope`` rows of each block of
    ``size`` from the half-split layout back to interleaved pairs."""
    perm = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)]) + size - rope
    order = np.arange(size)
    order[size - rope :] = perm
    blocks = w.reshape(-1, size, *w.shape[1:])
    out = np.empty_like(blocks)
    out[:, order] = blocks
    return out.reshape(w.shape)


def interleaved_rope(tensors: dict, c: dict) -> dict:
    """Export: the q and shared-key rows of the main attention back in DeepSeek's
    interleaved RoPE layout (the indexer's stay half-split, as transformers reads them)."""
    Hr, Hn, R = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["kv_lora_rank"]
    out = dict(tensors)
    for name, w in tensors.items():
        if name.endswith("self_attn.q_b_proj.weight"):
            out[name] = _interleave(w, Hn + Hr, Hr)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            out[name] = _interleave(w, R + Hr, Hr)
    return out


def deepseek_v32_writer(cfg):
    """DeepSeek-V3's config.json with the indexer's settings; every layer sparse."""
    if cfg.mixer != "dsa":
        raise ValueError(f"mixer={cfg.mixer!r}: DeepSeek-V3.2 attends with dsa")
    s = cfg.mixer_settings.resolved(cfg)
    if s.q_lora_rank is None:
        raise ValueError("mixer_settings.q_lora_rank=None: DeepSeek-V3.2 compresses q")
    out = deepseek_v3_writer(cfg.replace(mixer="mla", mixer_settings=_mla_fields(s)))
    del out["rope_interleave"]
    out.update(
        model_type="deepseek_v32",
        architectures=["DeepseekV32ForCausalLM"],
        index_topk=s.topk,
        index_n_heads=s.index_heads,
        index_head_dim=s.index_head_dim,
    )
    return out


def _mla_fields(s) -> dict:
    names = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return {n: getattr(s, n) for n in names}


register_family(
    Family(
        "deepseek_v32",
        config=deepseek_v32,
        mapping=DEEPSEEK_V32,
        write=deepseek_v32_writer,
        prepare=deepseek_rope_layout,
        finish=interleaved_rope,
        architectures=("DeepseekV32",),
    )
)
