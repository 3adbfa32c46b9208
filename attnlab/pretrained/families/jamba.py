"""Jamba (``JambaForCausalLM``): Mamba-1 layers with RMSNorms on dt, B and C (the ``mamba``
mixer with ``inner_norms``) and, every ``attn_layer_period`` layers from
``attn_layer_offset``, grouped-query attention without positions; the FFN a mixture of
experts every ``expert_layer_period`` layers from ``expert_layer_offset`` (softmax router,
top-k weights not renormalised, per-expert SwiGLU), a SwiGLU elsewhere. The per-layer kinds
become a ``block_pattern`` (``hf_base.prefix_and_block``)."""

from __future__ import annotations

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import base_config, single_mixers
from attnlab.pretrained.families.mamba import mamba_rows, mamba_settings
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import (
    UnsupportedCheckpointError,
    decoder_fields,
    prefix_and_block,
    reject,
    require,
)
from attnlab.pretrained.mappings import (
    A,
    L,
    Mapping,
    ends,
    gated_ffn,
    layer_rows,
    linear_attention,
    routed_experts,
    table,
)


def _every(c: dict, period: str, offset: str, n: int) -> list[bool]:
    p, o = require(c, period), require(c, offset)
    if not (isinstance(p, int) and isinstance(o, int) and 0 <= o < p):
        raise UnsupportedCheckpointError(
            f"config.json {period}={p!r} / {offset}={o!r} is not supported: give ints with "
            f"0 <= {offset} < {period}"
        )
    return [i % p == o for i in range(n)]


def jamba(c: dict) -> dict:
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Jamba's Mamba gates with silu")
    n = require(c, "num_hidden_layers")
    attention = _every(c, "attn_layer_period", "attn_layer_offset", n)
    experts = _every(c, "expert_layer_period", "expert_layer_offset", n)
    mamba = {
        "mixer": "mamba",
        "mixer_settings": {**mamba_settings(c, "mamba_"), "inner_norms": True},
    }
    kinds = [
        {**({"mixer": "mha"} if a else mamba), **({} if e else {"ffn_variant": "dense"})}
        for a, e in zip(attention, experts, strict=True)
    ]
    D, N = require(c, "hidden_size"), require(c, "num_attention_heads")
    return decoder_fields(
        c,
        head_dim=D // N,
        max_len=c.get("max_position_embeddings") or 262144,
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        ffn_variant="moe",
        ffn_settings={
            "n_experts": c.get("num_local_experts") or require(c, "num_experts"),
            "top_k": require(c, "num_experts_per_tok"),
            "renormalize": False,
            "load_balance_weight": float(c.get("router_aux_loss_coef", 0.001)),
            "z_loss_weight": 0.0,
        },
        block_pattern=prefix_and_block(kinds),
    )


_M, _X, _F = f"{L}.mamba", f"{A}.attn", f"{L}.feed_forward"
JAMBA = Mapping(
    prefix="model.",
    rules=table(
        ends(norm="model.final_layernorm"),
        layer_rows(ffn_norm="pre_ff_layernorm"),
        mamba_rows(_M, _X),
        (f"{_M}.dt_layernorm.weight", f"{_X}.dt_norm_R"),
        (f"{_M}.b_layernorm.weight", f"{_X}.b_norm_J"),
        (f"{_M}.c_layernorm.weight", f"{_X}.c_norm_J"),
        linear_attention(f"{L}.self_attn", _X, bias=False),
        gated_ffn(_F),
        routed_experts(_F, router="router"),
    ),
    ignore=("lm_head.weight",),
)


def _period(flags: list[bool]) -> tuple[int, int]:
    """``(period, offset)`` whose layers ``i % period == offset`` are the ``flags``."""
    n = len(flags)
    for p in range(1, n + 2):
        for o in range(p):
            if flags == [i % p == o for i in range(n)]:
                return p, o
    raise ValueError(f"layers {flags}: Jamba places them every period layers from an offset")


def jamba_writer(cfg):
    mixers = single_mixers(cfg, "Jamba", {"mamba": None, "mha": None})
    kinds = stack_plan(cfg, cfg.n_layers).kinds
    if any(k.ffn_variant not in ("moe", "dense") for k in kinds):
        raise ValueError("ffn_variant: Jamba's FFNs are experts or a dense SwiGLU")
    s = cfg.ffn_settings
    if not hasattr(s, "top_k") or s.renormalize or s.d_expert not in (None, cfg.d_ff):
        raise ValueError("ffn_settings: Jamba's experts are d_ff wide, not renormalised")
    out = base_config(cfg, "jamba", "JambaForCausalLM")
    del out["head_dim"], out["rope_parameters"], out["attention_bias"]
    attn_p, attn_o = _period([m.mixer == "mha" for m in mixers])
    exp_p, exp_o = _period([k.ffn_variant == "moe" for k in kinds])
    out.update(
        attn_layer_period=attn_p, attn_layer_offset=attn_o,
        expert_layer_period=exp_p, expert_layer_offset=exp_o,
        num_experts=s.n_experts, num_experts_per_tok=s.top_k,
        router_aux_loss_coef=s.load_balance_weight, use_mamba_kernels=False,
    )  # fmt: skip
    mamba = [m.mixer_settings.resolved(cfg) for m in mixers if m.mixer == "mamba"]
    if mamba:
        m = mamba[0]
        if not m.inner_norms:
            raise ValueError("mixer_settings.inner_norms: Jamba's Mamba norms dt, B and C")
        out.update(
            mamba_d_state=m.state_size, mamba_d_conv=m.conv_kernel, mamba_expand=m.expand,
            mamba_dt_rank=m.dt_rank, mamba_conv_bias=m.use_conv_bias,
            mamba_proj_bias=m.use_bias,
        )  # fmt: skip
    return out


register_family(
    Family("jamba", config=jamba, mapping=JAMBA, write=jamba_writer, architectures=("Jamba",))
)
