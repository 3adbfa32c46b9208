"""Tensor-name tables: Hugging Face checkpoint names -> attnlab parameter paths.

A ``Mapping`` is data: a list of ``Rule(hf, to, fn)``. ``hf`` is the stored tensor name
(``{i}`` stands for a layer index), followed by any tied aliases it may be stored under;
``to`` is one attnlab parameter path or several (a fused tensor split in order); ``fn``
names an entry of ``TRANSFORMS``. Paths are the dotted ``nnx.state`` paths of the model that
``attnlab.build_model`` builds from the translated config.

A rule applies only when its targets exist in that model: one table covers a family's
variants (q/k/v biases, QK-norm, gated or plain FFN, tied or untied head) and the config
decides which rules are active. Stored tensors that no active rule consumes are an error
unless they match one of the mapping's ``ignore`` patterns (tied copies, non-trainable
buffers). ``prefix`` is the wrapper of the task head class (``model.``, ``bert.``...): a
checkpoint of the bare base model, whose names lack it, gets it prepended.

Transforms (``attnlab.pretrained.transforms``) turn a stored tensor into the attnlab layout
and back.
"""

from __future__ import annotations

import dataclasses

from attnlab.pretrained.transforms import TRANSFORMS, split_experts, stack_experts

__all__ = ["TRANSFORMS", "Mapping", "Rule", "split_experts", "stack_experts"]


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # stored name first, then tied aliases
    to: tuple[str, ...]  # attnlab parameter path(s)
    fn: str = "copy"


@dataclasses.dataclass(frozen=True)
class Mapping:
    rules: tuple[Rule, ...]
    prefix: str = ""
    ignore: tuple[str, ...] = ()  # fnmatch patterns of stored names nothing needs
    per_expert: bool = True  # experts stored one tensor each (stacked on load), or stacked


def _rule(hf, to, fn="copy") -> Rule:
    as_tuple = lambda v: (v,) if isinstance(v, str) else tuple(v)
    return Rule(as_tuple(hf), as_tuple(to), fn)


def _table(*rows) -> tuple[Rule, ...]:
    out = []
    for row in rows:
        out.extend(row if isinstance(row, list) else [row])
    return tuple(_rule(*r) if isinstance(r, tuple) else r for r in out)


def _norm(hf, ours, *, bias=True):
    rows = [(f"{hf}.weight", f"{ours}.scale_D")]
    return rows + [(f"{hf}.bias", f"{ours}.bias_D")] if bias else rows


def _linear_attention(hf, ours, names=("q_proj", "k_proj", "v_proj", "o_proj"), bias=True):
    """Separate q/k/v/o ``nn.Linear`` projections, with optional biases."""
    q, k, v, o = (f"{hf}.{n}" for n in names)
    rows = [
        (f"{q}.weight", f"{ours}.q_DNH", "linear_to_heads"),
        (f"{k}.weight", f"{ours}.k_DKH", "linear_to_heads"),
        (f"{v}.weight", f"{ours}.v_DKH", "linear_to_heads"),
        (f"{o}.weight", f"{ours}.o_NHD", "linear_from_heads"),
    ]
    if bias:
        rows += [
            (f"{q}.bias", f"{ours}.q_bias_NH", "flat"),
            (f"{k}.bias", f"{ours}.k_bias_KH", "flat"),
            (f"{v}.bias", f"{ours}.v_bias_KH", "flat"),
            (f"{o}.bias", f"{ours}.o_bias_D"),
        ]
    return rows


def _linear_ffn(fc_in, fc_out, ours, *, bias=True):
    rows = [
        (f"{fc_in}.weight", f"{ours}.w_in_DF", "linear"),
        (f"{fc_out}.weight", f"{ours}.w_out_FD", "linear"),
    ]
    if bias:
        rows += [(f"{fc_in}.bias", f"{ours}.b_in_F"), (f"{fc_out}.bias", f"{ours}.b_out_D")]
    return rows


# GPT-2 ------------------------------------------------------------------------------------
_G = "transformer.h.{i}"
_A = "decoder.layers.{i}"
GPT2 = Mapping(
    prefix="transformer.",
    rules=_table(
        ("transformer.wte.weight", "embed.tokens.embedding_VD"),
        ("transformer.wpe.weight", "decoder.positions.table_PD"),
        _norm(f"{_G}.ln_1", f"{_A}.attn_norm"),
        (
            f"{_G}.attn.c_attn.weight",
            (f"{_A}.attn.q_DNH", f"{_A}.attn.k_DKH", f"{_A}.attn.v_DKH"),
            "fused_columns_to_heads",
        ),
        (
            f"{_G}.attn.c_attn.bias",
            (f"{_A}.attn.q_bias_NH", f"{_A}.attn.k_bias_KH", f"{_A}.attn.v_bias_KH"),
            "fused_flat",
        ),
        (f"{_G}.attn.c_proj.weight", f"{_A}.attn.o_NHD", "rows_from_heads"),
        (f"{_G}.attn.c_proj.bias", f"{_A}.attn.o_bias_D"),
        _norm(f"{_G}.ln_2", f"{_A}.ffn_norm"),
        (f"{_G}.mlp.c_fc.weight", f"{_A}.ffn.w_in_DF"),  # Conv1D is already [in, out]
        (f"{_G}.mlp.c_fc.bias", f"{_A}.ffn.b_in_F"),
        (f"{_G}.mlp.c_proj.weight", f"{_A}.ffn.w_out_FD"),
        (f"{_G}.mlp.c_proj.bias", f"{_A}.ffn.b_out_D"),
        _norm("transformer.ln_f", "decoder.final_norm"),
        ("lm_head.weight", "head.head_DV", "linear"),
    ),
    # Causal-mask buffers of older files; the tied head copy.
    ignore=("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias", "lm_head.weight"),
)

# Llama, Mistral, Qwen2, Qwen3 --------------------------------------------------------------
_L = "model.layers.{i}"
LLAMA = Mapping(
    prefix="model.",
    rules=_table(
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        _norm(f"{_L}.input_layernorm", f"{_A}.attn_norm", bias=False),
        _linear_attention(f"{_L}.self_attn", f"{_A}.attn"),
        _norm(f"{_L}.self_attn.q_norm", f"{_A}.attn.q_norm", bias=False),
        _norm(f"{_L}.self_attn.k_norm", f"{_A}.attn.k_norm", bias=False),
        _norm(f"{_L}.post_attention_layernorm", f"{_A}.ffn_norm", bias=False),
        (f"{_L}.mlp.gate_proj.weight", f"{_A}.ffn.w_gate_DF", "linear"),
        (f"{_L}.mlp.up_proj.weight", f"{_A}.ffn.w_in_DF", "linear"),
        (f"{_L}.mlp.down_proj.weight", f"{_A}.ffn.w_out_FD", "linear"),
        _norm("model.norm", "decoder.final_norm", bias=False),
        ("lm_head.weight", "head.head_DV", "linear"),
    ),
    ignore=("model.layers.*.self_attn.rotary_emb.inv_freq", "lm_head.weight"),
)

# BERT (masked LM) ---------------------------------------------------------------------
_B = "bert.encoder.layer.{i}"
_E = "encoder.layers.{i}"
BERT = Mapping(
    prefix="bert.",
    rules=_table(
        ("bert.embeddings.word_embeddings.weight", "embed.tokens.embedding_VD"),
        ("bert.embeddings.position_embeddings.weight", "encoder.positions.table_PD"),
        ("bert.embeddings.token_type_embeddings.weight", "token_types_YD"),
        _norm("bert.embeddings.LayerNorm", "encoder.embed_norm"),
        _linear_attention(
            f"{_B}.attention",
            f"{_E}.attn",
            names=("self.query", "self.key", "self.value", "output.dense"),
        ),
        _norm(f"{_B}.attention.output.LayerNorm", f"{_E}.attn_norm"),
        _linear_ffn(f"{_B}.intermediate.dense", f"{_B}.output.dense", f"{_E}.ffn"),
        _norm(f"{_B}.output.LayerNorm", f"{_E}.ffn_norm"),
        ("cls.predictions.transform.dense.weight", "transform_DD", "linear"),
        ("cls.predictions.transform.dense.bias", "transform_bias_D"),
        _norm("cls.predictions.transform.LayerNorm", "transform_norm"),
        (("cls.predictions.bias", "cls.predictions.decoder.bias"), "head.bias_V"),
        ("cls.predictions.decoder.weight", "head.head_DV", "linear"),
    ),
    ignore=(
        "bert.embeddings.position_ids",
        "bert.pooler.*",  # sentence-level heads of other BERT classes
        "cls.seq_relationship.*",
        "cls.predictions.decoder.weight",
    ),
)


# BART and Marian ----------------------------------------------------------------------
def _bart_stack(stack):
    hf, ours = f"model.{stack}.layers.{{i}}", f"{stack}.layers.{{i}}"
    rows = _linear_attention(
        f"{hf}.self_attn", f"{ours}.attn", names=("q_proj", "k_proj", "v_proj", "out_proj")
    )
    rows += _norm(f"{hf}.self_attn_layer_norm", f"{ours}.attn_norm")
    if stack == "decoder":
        rows += _linear_attention(
            f"{hf}.encoder_attn",
            f"{ours}.cross_attn",
            names=("q_proj", "k_proj", "v_proj", "out_proj"),
        )
        rows += _norm(f"{hf}.encoder_attn_layer_norm", f"{ours}.cross_norm")
    rows += _linear_ffn(f"{hf}.fc1", f"{hf}.fc2", f"{ours}.ffn")
    rows += _norm(f"{hf}.final_layer_norm", f"{ours}.ffn_norm")
    rows += [(f"model.{stack}.embed_positions.weight", f"{stack}.positions.table_PD")]
    rows += _norm(f"model.{stack}.layernorm_embedding", f"{stack}.embed_norm")
    return rows


BART = Mapping(
    prefix="model.",
    rules=_table(
        (
            (
                "model.shared.weight",
                "model.encoder.embed_tokens.weight",
                "model.decoder.embed_tokens.weight",
            ),
            "embed.tokens.embedding_VD",
        ),
        _bart_stack("encoder"),
        _bart_stack("decoder"),
        ("final_logits_bias", "head.bias_V", "row"),
        ("lm_head.weight", "head.head_DV", "linear"),
    ),
    ignore=(
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
        "model.*.embed_positions.weight",  # fixed sinusoidal tables (Marian), never learned
        "lm_head.weight",
    ),
)


# T5 -----------------------------------------------------------------------------------
def _t5_stack(stack):
    hf, ours = f"{stack}.block.{{i}}.layer", f"{stack}.layers.{{i}}"
    names = ("q", "k", "v", "o")
    rows = _linear_attention(f"{hf}.0.SelfAttention", f"{ours}.attn", names=names, bias=False)
    rows += _norm(f"{hf}.0.layer_norm", f"{ours}.attn_norm", bias=False)
    ff = 1
    if stack == "decoder":
        rows += _linear_attention(
            f"{hf}.1.EncDecAttention", f"{ours}.cross_attn", names=names, bias=False
        )
        rows += _norm(f"{hf}.1.layer_norm", f"{ours}.cross_norm", bias=False)
        ff = 2
    dense = f"{hf}.{ff}.DenseReluDense"
    rows += [
        (f"{dense}.wi_0.weight", f"{ours}.ffn.w_gate_DF", "linear"),  # gated variants only
        ((f"{dense}.wi_1.weight", f"{dense}.wi.weight"), f"{ours}.ffn.w_in_DF", "linear"),
        (f"{dense}.wo.weight", f"{ours}.ffn.w_out_FD", "linear"),
    ]
    rows += _norm(f"{hf}.{ff}.layer_norm", f"{ours}.ffn_norm", bias=False)
    rows += _norm(f"{stack}.final_layer_norm", f"{stack}.final_norm", bias=False)
    # One table per stack, stored on its first block and shared by all layers.
    rows += [
        (
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            f"{stack}.relative.table_XN",
        )
    ]
    return rows


T5 = Mapping(
    rules=_table(
        (
            ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"),
            "embed.tokens.embedding_VD",
        ),
        _t5_stack("encoder"),
        _t5_stack("decoder"),
        ("lm_head.weight", "head.head_DV", "linear"),
    ),
    ignore=(
        "encoder.embed_tokens.weight",
        "decoder.embed_tokens.weight",
        "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
        "lm_head.weight",
    ),
)

MAPPINGS = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "bert": BERT,
    "bart": BART,
    "marian": BART,
    "t5": T5,
}
