"""Tensor-name tables: Hugging Face checkpoint names -> attnlab parameter paths, and the rows
the families' tables share (each family's table is its ``Family.mapping``, in its file under
``attnlab/pretrained/families``).

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

__all__ = [
    "TRANSFORMS",
    "Mapping",
    "Rule",
    "deepseek_experts",
    "ends",
    "gated_ffn",
    "linear_attention",
    "linear_ffn",
    "moe_table",
    "norm_row",
    "norm_rows",
    "split_experts",
    "stack_experts",
    "table",
]


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


def rule(hf, to, fn="copy") -> Rule:
    as_tuple = lambda v: (v,) if isinstance(v, str) else tuple(v)
    return Rule(as_tuple(hf), as_tuple(to), fn)


def table(*rows) -> tuple[Rule, ...]:
    out = []
    for row in rows:
        out.extend(row if isinstance(row, list) else [row])
    return tuple(rule(*r) if isinstance(r, tuple) else r for r in out)


def norm_rows(hf, ours, *, bias=True):
    rows = [(f"{hf}.weight", f"{ours}.scale_D")]
    return rows + [(f"{hf}.bias", f"{ours}.bias_D")] if bias else rows


def linear_attention(hf, ours, names=("q_proj", "k_proj", "v_proj", "o_proj"), bias=True):
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


def linear_ffn(fc_in, fc_out, ours, *, bias=True):
    rows = [
        (f"{fc_in}.weight", f"{ours}.w_in_DF", "linear"),
        (f"{fc_out}.weight", f"{ours}.w_out_FD", "linear"),
    ]
    if bias:
        rows += [(f"{fc_in}.bias", f"{ours}.b_in_F"), (f"{fc_out}.bias", f"{ours}.b_out_D")]
    return rows


# Rows of the Llama-shaped decoders (``model.layers.{i}`` -> ``decoder.layers.{i}``).
L = "model.layers.{i}"
A = "decoder.layers.{i}"
# The rotary buffers of older files and a tied head's copy.
IGNORE = ("model.layers.*.self_attn.rotary_emb.inv_freq", "lm_head.weight")


def norm_row(hf, ours, fn="copy"):
    """One norm's weight row (``fn="plus_one"``: stored as ``w`` for a scale of ``1 + w``)."""
    return (f"{hf}.weight", f"{ours}.scale_D", fn)


def gated_ffn(hf=f"{L}.mlp", ours=f"{A}.ffn"):
    """A SwiGLU FFN's ``gate_proj``, ``up_proj`` and ``down_proj``."""
    return [
        (f"{hf}.gate_proj.weight", f"{ours}.w_gate_DF", "linear"),
        (f"{hf}.up_proj.weight", f"{ours}.w_in_DF", "linear"),
        (f"{hf}.down_proj.weight", f"{ours}.w_out_FD", "linear"),
    ]


def deepseek_experts(hf=f"{L}.mlp", names=("gate_proj", "up_proj", "down_proj")):
    """DeepSeek-style experts under ``hf``: the SwiGLU FFN of the dense first layers, then a
    router with its selection bias, per-expert FFNs (``names``: their gate, up and down
    projections) and shared experts."""
    gate, up, down = names
    return [
        *gated_ffn(hf),
        (f"{hf}.gate.weight", f"{A}.ffn.router_DE", "linear"),
        (f"{hf}.gate.e_score_correction_bias", f"{A}.ffn.selection_bias_E"),
        (f"{hf}.experts.{gate}.weight", f"{A}.ffn.w_gate_EDF", "experts_linear"),
        (f"{hf}.experts.{up}.weight", f"{A}.ffn.w_in_EDF", "experts_linear"),
        (f"{hf}.experts.{down}.weight", f"{A}.ffn.w_out_EFD", "experts_linear"),
        (f"{hf}.shared_experts.gate_proj.weight", f"{A}.ffn.shared_gate_DF", "linear"),
        (f"{hf}.shared_experts.up_proj.weight", f"{A}.ffn.shared_in_DF", "linear"),
        (f"{hf}.shared_experts.down_proj.weight", f"{A}.ffn.shared_out_FD", "linear"),
    ]


def ends(fn="copy"):
    """The embedding, the final norm and the head of a Llama-shaped decoder."""
    return [
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        norm_row("model.norm", "decoder.final_norm", fn),
        ("lm_head.weight", "head.head_DV", "linear"),
    ]


def moe_table(moe, gate, up, down, *, qk_norm, dense=False) -> Mapping:
    """A Llama-shaped decoder with a router and per-expert FFNs (stacked on load) under
    ``model.layers.{i}.{moe}``; ``dense``: some layers keep the plain SwiGLU FFN."""
    rows = [
        ends(),
        norm_row(f"{L}.input_layernorm", f"{A}.attn_norm"),
        linear_attention(f"{L}.self_attn", f"{A}.attn", bias=False),
        norm_row(f"{L}.post_attention_layernorm", f"{A}.ffn_norm"),
        (f"{L}.{moe}.gate.weight", f"{A}.ffn.router_DE", "linear"),
        (f"{L}.{moe}.experts.{gate}.weight", f"{A}.ffn.w_gate_EDF", "experts_linear"),
        (f"{L}.{moe}.experts.{up}.weight", f"{A}.ffn.w_in_EDF", "experts_linear"),
        (f"{L}.{moe}.experts.{down}.weight", f"{A}.ffn.w_out_EFD", "experts_linear"),
    ]
    if qk_norm:
        rows += [
            norm_row(f"{L}.self_attn.q_norm", f"{A}.attn.q_norm"),
            norm_row(f"{L}.self_attn.k_norm", f"{A}.attn.k_norm"),
        ]
    if dense:  # the plain FFN of the layers whose config keeps no experts
        rows.append(gated_ffn())
    return Mapping(prefix="model.", rules=table(*rows), ignore=IGNORE)
