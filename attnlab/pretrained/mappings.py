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
    "fused",
    "gated_ffn",
    "layer_rows",
    "linear_attention",
    "linear_ffn",
    "llama_mapping",
    "moe_table",
    "norm_row",
    "norm_rows",
    "qk_norms",
    "routed_experts",
    "self_attention",
    "shared_expert",
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


def fused(hf, ours, weights, biases, fn):
    """A projection stored fused (``hf``): its weight split in order into ``weights`` by
    ``fn``, its bias into ``biases`` (the parameters' names under ``ours``)."""
    at = lambda names: tuple(f"{ours}.{name}" for name in names)
    return [(f"{hf}.weight", at(weights), fn), (f"{hf}.bias", at(biases), "fused_flat")]


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
# A SwiGLU's stored gate, up and down projections, and attnlab's of a dense one, of the
# shared expert beside routed ones and of the routed experts.
SWIGLU = ("gate_proj", "up_proj", "down_proj")
_DENSE = ("w_gate_DF", "w_in_DF", "w_out_FD")
_SHARED = ("shared_gate_DF", "shared_in_DF", "shared_out_FD")
_EXPERTS = ("w_gate_EDF", "w_in_EDF", "w_out_EFD")


def norm_row(hf, ours, fn="copy"):
    """One norm's weight row (``fn="plus_one"``: stored as ``w`` for a scale of ``1 + w``)."""
    return (f"{hf}.weight", f"{ours}.scale_D", fn)


def qk_norms(hf=f"{L}.self_attn", ours=f"{A}.attn", fn="copy", names=("q_norm", "k_norm")):
    """QK-norm's rows: the norms of the queries and the keys (stored as ``names``)."""
    q, k = names
    return [
        norm_row(f"{hf}.{q}", f"{ours}.q_norm", fn),
        norm_row(f"{hf}.{k}", f"{ours}.k_norm", fn),
    ]


def self_attention(*, bias=True, qk_norm=False, fn="copy"):
    """A Llama-shaped layer's attention (``self_attn``): its q/k/v/o projections (``bias``:
    with biases), then QK-norm's rows when ``qk_norm`` (the norms stored as ``fn`` says)."""
    rows = linear_attention(f"{L}.self_attn", f"{A}.attn", bias=bias)
    return rows + qk_norms(fn=fn) if qk_norm else rows


def layer_rows(
    mixer=(), *, attn_norm="input_layernorm", ffn_norm="post_attention_layernorm", fn="copy"
):
    """A pre-norm layer's rows: the norm before its mixer, the ``mixer``'s rows, the norm
    before its FFN (the stored norms named ``attn_norm`` and ``ffn_norm``, stored as ``fn``)."""
    return [
        norm_row(f"{L}.{attn_norm}", f"{A}.attn_norm", fn),
        *mixer,
        norm_row(f"{L}.{ffn_norm}", f"{A}.ffn_norm", fn),
    ]


def _swiglu(hf, names, params, fn):
    return [(f"{hf}.{name}.weight", p, fn) for name, p in zip(names, params, strict=True)]


def gated_ffn(hf=f"{L}.mlp", ours=f"{A}.ffn", names=SWIGLU):
    """A SwiGLU FFN's gate, up and down projections (stored as ``names``)."""
    return _swiglu(hf, names, [f"{ours}.{p}" for p in _DENSE], "linear")


def shared_expert(hf):
    """The SwiGLU of a shared expert beside the routed ones, stored under ``hf``."""
    return _swiglu(hf, SWIGLU, [f"{A}.ffn.{p}" for p in _SHARED], "linear")


def routed_experts(hf, names=SWIGLU, *, router="gate", selection_bias=False):
    """A router (``{hf}.{router}``, with DeepSeek's ``selection_bias`` when set) and the
    experts' SwiGLUs under ``{hf}.experts`` (``names``), stored one tensor per expert."""
    rows = [(f"{hf}.{router}.weight", f"{A}.ffn.router_DE", "linear")]
    if selection_bias:
        rows.append((f"{hf}.{router}.e_score_correction_bias", f"{A}.ffn.selection_bias_E"))
    experts = [f"{A}.ffn.{p}" for p in _EXPERTS]
    return rows + _swiglu(f"{hf}.experts", names, experts, "experts_linear")


def deepseek_experts(hf=f"{L}.mlp", names=SWIGLU):
    """DeepSeek-style experts under ``hf``: the SwiGLU FFN of the dense first layers, then a
    router with its selection bias, per-expert FFNs (``names``: their gate, up and down
    projections) and shared experts."""
    return [
        *gated_ffn(hf),
        *routed_experts(hf, names, selection_bias=True),
        *shared_expert(f"{hf}.shared_experts"),
    ]


def ends(fn="copy", norm="model.norm"):
    """The embedding, the final norm (stored as ``norm``) and the head of a Llama-shaped
    decoder."""
    return [
        ("model.embed_tokens.weight", "embed.tokens.embedding_VD"),
        norm_row(norm, "decoder.final_norm", fn),
        ("lm_head.weight", "head.head_DV", "linear"),
    ]


def llama_mapping(*rows, fn="copy", per_expert=True) -> Mapping:
    """The table of a Llama-shaped decoder stored under ``model.``: its ends (norms stored as
    ``fn`` says), then ``rows``; the rotary buffers and a tied head's copy ignored."""
    return Mapping(
        prefix="model.", rules=table(ends(fn), *rows), ignore=IGNORE, per_expert=per_expert
    )


def moe_table(moe, gate, up, down, *, qk_norm, dense=False) -> Mapping:
    """A Llama-shaped decoder with a router and per-expert FFNs (stacked on load) under
    ``model.layers.{i}.{moe}``; ``dense``: some layers keep the plain SwiGLU FFN."""
    rows = [
        layer_rows(self_attention(bias=False)),
        routed_experts(f"{L}.{moe}", (gate, up, down)),
        qk_norms() if qk_norm else [],
        gated_ffn() if dense else [],  # the plain FFN of the layers whose config keeps no experts
    ]
    return llama_mapping(*rows)
