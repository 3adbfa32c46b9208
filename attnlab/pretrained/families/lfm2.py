"""LFM2 (``Lfm2ForCausalLM``): a hybrid of LFM2's gated short convolutions (``short_conv``)
and grouped-query attention with QK-norm per head (``layer_types``: ``conv`` or
``full_attention``), each layer then a SwiGLU FFN whose width transformers derives from
``intermediate_size`` (``block_auto_adjust_ff_dim``: two thirds of it, times
``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``). The final norm is named
``embedding_norm``; the layer kinds become a ``block_pattern`` as Bamba's."""

from __future__ import annotations

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import base_config, single_mixers
from attnlab.pretrained.families.llama import llama_like
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    checked_layer_types,
    prefix_and_block,
    require,
)
from attnlab.pretrained.mappings import (
    IGNORE,
    A,
    L,
    Mapping,
    ends,
    fused,
    gated_ffn,
    layer_rows,
    linear_attention,
    qk_norms,
    table,
)

_TYPES = ("conv", "full_attention")


def _layer_types(c: dict) -> list[str]:
    n = require(c, "num_hidden_layers")
    types = c.get("layer_types")
    if types is None:
        full = c.get("full_attn_idxs")
        full = range(n) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    return checked_layer_types(types, n, _TYPES)


def ffn_width(c: dict) -> int:
    """The SwiGLU width transformers builds from ``intermediate_size``."""
    width = require(c, "intermediate_size")
    if c.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = c.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            step = c.get("block_multiple_of", 256)
            width = step * ((int(multiplier * width) + step - 1) // step)
    return width


def lfm2(c: dict) -> dict:
    conv = {
        "mixer": "short_conv",
        "mixer_settings": {
            "conv_kernel": c.get("conv_L_cache", 3),
            "bias": bool(c.get("conv_bias", False)),
        },
    }
    kinds = [conv if t == "conv" else {"mixer": "mha"} for t in _layer_types(c)]
    plain = {k: v for k, v in c.items() if k != "layer_types"}  # conv layers: no windows
    return llama_like(
        plain,
        qkv_bias=False,
        o_bias=False,
        qk_norm=True,
        d_ff=ffn_width(c),
        norm_eps=c.get("norm_eps", 1e-5),
        tie_embeddings=c.get("tie_word_embeddings", c.get("tie_embedding", True)) is not False,
        block_pattern=prefix_and_block(kinds),
    )


_C, _X = f"{L}.conv", f"{A}.attn"
_BCH = ("b_proj_DZ", "c_proj_DZ", "h_proj_DZ")
LFM2 = Mapping(
    prefix="model.",
    rules=table(
        ends(norm="model.embedding_norm"),
        layer_rows(attn_norm="operator_norm", ffn_norm="ffn_norm"),
        linear_attention(
            f"{L}.self_attn", _X, names=("q_proj", "k_proj", "v_proj", "out_proj"), bias=False
        ),
        qk_norms(names=("q_layernorm", "k_layernorm")),
        # in_proj's rows: the input gate b, the output gate c, the input h.
        fused(f"{_C}.in_proj", _X, _BCH, ("b_bias_Z", "c_bias_Z", "h_bias_Z"), "fused_linear"),
        (f"{_C}.conv.weight", f"{_X}.conv_WZ", "depthwise_conv"),
        (f"{_C}.conv.bias", f"{_X}.conv_bias_Z"),
        (f"{_C}.out_proj.weight", f"{_X}.out_ZD", "linear"),
        (f"{_C}.out_proj.bias", f"{_X}.out_bias_D"),
        gated_ffn(f"{L}.feed_forward", names=("w1", "w3", "w2")),
    ),
    ignore=IGNORE,
)


def lfm2_writer(cfg):
    mixers = single_mixers(cfg, "LFM2", {"short_conv": None, "mha": None})
    if any(k.ffn_variant != "dense" for k in stack_plan(cfg, cfg.n_layers).kinds):
        raise ValueError("ffn_variant: LFM2's layers each have a dense SwiGLU FFN")
    out = base_config(cfg, "lfm2", "Lfm2ForCausalLM")
    out["norm_eps"] = out.pop("rms_norm_eps")
    out["block_auto_adjust_ff_dim"] = False
    out["layer_types"] = ["conv" if m.mixer == "short_conv" else "full_attention" for m in mixers]
    convs = [m.mixer_settings for m in mixers if m.mixer == "short_conv"]
    if convs:
        out.update(conv_L_cache=convs[0].conv_kernel, conv_bias=convs[0].bias)
    return out


register_family(
    Family("lfm2", config=lfm2, mapping=LFM2, write=lfm2_writer, architectures=("Lfm2",))
)
