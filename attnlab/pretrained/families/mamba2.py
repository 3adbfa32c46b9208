"""State-space checkpoints: transformers' ``Mamba2ForCausalLM``, its config.json translator
and tensor-name table.

Every layer is ``norm -> Mamba2Mixer -> residual`` with no MLP: attnlab builds it as a
pre-norm decoder whose mixer is ``mamba2`` (``attnlab.nn.mixers.mamba2``, parameters in
transformers' layout) and whose FFN is ``ffn_variant="none"``. There are no positions; the
attention fields of the ``ModelConfig`` (heads, ``d_ff``) size nothing.
"""

from __future__ import annotations

import math

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained.export_configs import mamba2_keys, single_mixers
from attnlab.pretrained.family import Family, register_family
from attnlab.pretrained.hf_base import common_fields, reject, require
from attnlab.pretrained.mappings import Mapping, table

# Mamba-2 keeps no positions; a cache of a recurrent layer does not grow with it either.
MAMBA2_MAX_LEN = 1 << 20


def _chunk_size(c: dict) -> int:
    """transformers' chunk size when a power of two (it changes no output), else 64."""
    size = c.get("chunk_size") or 64
    return size if size & (size - 1) == 0 else 64


def _number(v) -> float:
    """A float of config.json; transformers 5 writes infinity as ``{"__float__": "Infinity"}``."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def _dt_limit(c: dict) -> tuple[float, float | None]:
    low, high = (_number(v) for v in c.get("time_step_limit") or (0.0, math.inf))
    return low, None if math.isinf(high) else high


# Mamba2Config's key of each ``mamba2`` setting; the hybrids name them otherwise.
MAMBA2_KEYS = {
    "expand": "expand",
    "head_dim": "head_dim",
    "num_heads": "num_heads",
    "state_size": "state_size",
    "n_groups": "n_groups",
    "conv_kernel": "conv_kernel",
    "chunk_size": "chunk_size",
    "use_conv_bias": "use_conv_bias",
    "use_bias": "use_bias",
}
_DEFAULTS = {"expand": 2, "head_dim": 64, "state_size": 128, "n_groups": 1, "conv_kernel": 4,
             "use_conv_bias": True, "use_bias": False}  # fmt: skip


def mamba2_settings(c: dict, keys: dict = MAMBA2_KEYS) -> dict:
    """The ``mamba2`` mixer settings of config.json ``c`` whose keys are ``keys`` (ours ->
    theirs); ``time_step_limit`` as the dt limits."""
    get = lambda ours: c.get(keys[ours], _DEFAULTS.get(ours))
    low, high = _dt_limit(c)
    return {
        "expand": get("expand"),
        "head_dim": get("head_dim"),
        "num_heads": require(c, keys["num_heads"]),
        "state_size": get("state_size"),
        "n_groups": get("n_groups"),
        "conv_kernel": get("conv_kernel"),
        "chunk_size": _chunk_size({"chunk_size": get("chunk_size")}),
        "use_conv_bias": bool(get("use_conv_bias")),
        "use_bias": bool(get("use_bias")),
        "dt_limit_min": low,
        "dt_limit_max": high,
        "time_step_min": float(c.get("time_step_min", 0.001)),
        "time_step_max": float(c.get("time_step_max", 0.1)),
        "time_step_floor": float(c.get("time_step_floor", 1e-4)),
    }


def mamba2(c: dict) -> dict:
    """``Mamba2Config`` -> a decoder of ``mamba2`` layers without FFN."""
    reject(c, "hidden_act", lambda v: v not in (None, "silu"), "Mamba-2 gates with silu only")
    reject(c, "rms_norm", lambda v: v is False, "the gated RMSNorm is always applied")
    return ssm_decoder(c, "mamba2", mamba2_settings, tie=False)


def ssm_decoder(c: dict, mixer: str, settings, *, tie: bool) -> dict:
    """The fields of a Mamba checkpoint's model: a pre-norm decoder of ``mixer`` layers
    (``settings(c)``) without FFN or positions; ``tie`` is ``tie_word_embeddings``'s
    default."""
    return common_fields(
        c,
        arch="decoder",
        vocab_size=require(c, "vocab_size"),
        d_model=require(c, "hidden_size"),
        n_layers=require(c, "num_hidden_layers"),
        n_heads=1,
        max_len=MAMBA2_MAX_LEN,
        position="none",
        norm="rmsnorm",
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        norm_placement="pre",
        final_norm=True,
        mixer=mixer,
        mixer_settings=settings(c),
        ffn_variant="none",
        tie_embeddings=bool(c.get("tie_word_embeddings", tie)),
    )


def ssm_rows(hf: str, ours: str, *rows) -> list:
    """Table rows of a Mamba mixer (``hf`` -> ``ours``): its input projection and convolution,
    the ``rows`` of its own, its output projection."""
    return [
        (f"{hf}.in_proj.weight", f"{ours}.in_proj_DZ", "linear"),
        (f"{hf}.in_proj.bias", f"{ours}.in_proj_bias_Z"),
        (f"{hf}.conv1d.weight", f"{ours}.conv_WZ", "depthwise_conv"),
        (f"{hf}.conv1d.bias", f"{ours}.conv_bias_Z"),
        *rows,
        (f"{hf}.out_proj.weight", f"{ours}.out_proj_ZD", "linear"),
        (f"{hf}.out_proj.bias", f"{ours}.out_proj_bias_D"),
    ]


def mamba2_rows(hf: str, ours: str) -> list:
    """Table rows of one Mamba-2 mixer: transformers' ``hf`` -> attnlab's ``ours``."""
    return ssm_rows(
        hf,
        ours,
        (f"{hf}.dt_bias", f"{ours}.dt_bias_N"),
        (f"{hf}.A_log", f"{ours}.A_log_N"),
        (f"{hf}.D", f"{ours}.D_N"),
        (f"{hf}.norm.weight", f"{ours}.norm_scale_Z"),
    )


def ssm_mapping(rows) -> Mapping:
    """The tensor table of a Mamba checkpoint whose mixers' rows are ``rows(hf, ours)``: each
    layer's one norm is the mixer's (the unused FFN norm filled), no FFN."""
    L = "backbone.layers.{i}"
    return Mapping(
        prefix="backbone.",
        rules=table(
            ("backbone.embeddings.weight", "embed.tokens.embedding_VD"),
            ("backbone.norm_f.weight", "decoder.final_norm.scale_D"),
            ("lm_head.weight", "head.head_DV", "linear"),
            (
                f"{L}.norm.weight",
                ("decoder.layers.{i}.attn_norm.scale_D", "decoder.layers.{i}.ffn_norm.scale_D"),
                "norm_and_unused",
            ),
            rows(f"{L}.mixer", "decoder.layers.{i}.attn"),
        ),
        ignore=("lm_head.weight",),
    )


MAMBA2 = ssm_mapping(mamba2_rows)


def ssm_mixer_settings(cfg, name: str, mixer: str):
    """The resolved settings of a decoder whose every layer is one ``mixer`` with no FFN,
    which a Mamba checkpoint (family ``name``) can hold; anything else raises."""
    mixers = single_mixers(cfg, name, {mixer: None})
    if any(k.ffn_variant != "none" for k in stack_plan(cfg, cfg.n_layers).kinds):
        raise ValueError(f"ffn_variant: {name}'s layers have no FFN ('none')")
    if cfg.arch != "decoder":
        raise ValueError(f"arch={cfg.arch!r}: export-hf writes decoder-only models")
    return mixers[0].mixer_settings.resolved(cfg)


def ssm_config_json(cfg, s, model_type: str, keys: dict, **extra) -> dict:
    """The config.json of a Mamba checkpoint of ``cfg`` with mixer settings ``s``: the
    family's ``model_type``, its mixer ``keys`` and ``extra`` keys among the shared ones."""
    return {
        "model_type": model_type,
        "architectures": [f"{model_type.capitalize()}ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        **keys,
        "time_step_min": s.time_step_min,
        "time_step_max": s.time_step_max,
        "time_step_floor": s.time_step_floor,
        "layer_norm_epsilon": cfg.norm_eps,
        "hidden_act": "silu",
        **extra,
        "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_id,
        "dtype": "float32",
    }


def mamba2_writer(cfg):
    """Every layer one ``mamba2`` mixer with no FFN (``ffn_variant="none"``)."""
    s = ssm_mixer_settings(cfg, "Mamba-2", "mamba2")
    return ssm_config_json(cfg, s, "mamba2", mamba2_keys(s, MAMBA2_KEYS), rms_norm=True)


register_family(
    Family("mamba2", config=mamba2, mapping=MAMBA2, write=mamba2_writer, architectures=("Mamba2",))
)
