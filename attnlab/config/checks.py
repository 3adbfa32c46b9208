"""The rules of ``ModelConfig``: the choices a field may take and the checks that run on
construction, each naming the offending field and the fix (``ConfigError``)."""

from __future__ import annotations

import dataclasses

import jax

from attnlab.config import parametrization
from attnlab.config.architectures import ARCHITECTURES, architecture
from attnlab.contracts.ffn import get_ffn
from attnlab.contracts.mixer import get_mixer
from attnlab.contracts.score_function import attention_variants
from attnlab.errors import ConfigError
from attnlab.ops.activations import FFN_KINDS
from attnlab.ops.activations import PARAMETERS as ACTIVATION_PARAMETERS
from attnlab.ops.attention import BLOCKWISE, IMPLEMENTATIONS
from attnlab.ops.context_parallel import METHODS as CONTEXT_PARALLEL
from attnlab.ops.positions import ROPE_SCALINGS, RopeScaling

ARCHS = tuple(ARCHITECTURES)
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "relative", "none")
NORMS = ("layernorm", "rmsnorm")
# pre: x + f(norm(x)); post: norm(x + f(x)); sandwich: x + norm2(f(norm1(x))) (Gemma 2/3);
# output: x + norm(f(x)) (OLMo 2).
NORM_PLACEMENTS = ("pre", "post", "sandwich", "output")
DTYPES = ("float32", "bfloat16", "float16", "float64")
REMAT = ("none", "full", "dots")
DECODE_LAYERS = ("auto", "unstacked", "scan")


def _fail(field, value, fix):
    raise ConfigError(f"ModelConfig.{field}={value!r} is invalid: {fix}")


def _choice(cfg, field, options):
    value = getattr(cfg, field)
    if value not in options:
        _fail(field, value, f"use one of {list(options)}")


def _derivations(cfg):
    """(field, value) for every field that None derives, in dependency order."""
    head_dim_follows_width = cfg.head_dim is None  # read before it is derived
    yield "n_kv_heads", cfg.n_heads
    if cfg.head_dim is None and cfg.d_model % cfg.n_heads:
        _fail(
            "d_model",
            cfg.d_model,
            f"d_model must be divisible by n_heads={cfg.n_heads}, or set head_dim explicitly",
        )
    yield "head_dim", cfg.d_model // cfg.n_heads
    yield "d_ff", 4 * cfg.d_model
    yield "n_decoder_layers", cfg.n_layers
    yield "final_norm", cfg.norm_placement != "post"
    yield "attn_scale", parametrization.attention_scale(cfg, head_dim_follows_width)


def validate_raw(cfg) -> None:
    """Checks the sizes that derived values are computed from."""
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(field, value, "must be a positive integer")
    optional = ("n_decoder_layers", "n_kv_heads", "head_dim", "d_ff", "sliding_window")
    for field in optional + ("attention_block_q", "attention_block_k"):
        value = getattr(cfg, field)
        if value is not None and (not isinstance(value, int) or value <= 0):
            _fail(field, value, "must be a positive integer, or None for the default")


# The fields each RoPE scaling reads besides kind and factor.
_SCALING_FIELDS = {
    "linear": (),
    "llama3": ("original_max_len", "low_freq_factor", "high_freq_factor"),
    "yarn": ("original_max_len", "beta_fast", "beta_slow", "truncate", "mscale",
             "mscale_all_dim", "attention_factor"),
    "longrope": ("original_max_len", "short_factor", "long_factor", "attention_factor"),
}  # fmt: skip


def rope_scaling_of(value) -> RopeScaling | None:
    """``ModelConfig.rope_scaling`` (None, a dict of ``RopeScaling``'s fields or one) as a
    checked ``RopeScaling``."""
    if isinstance(value, dict) and value.get("kind") is None:  # an experiment's unset group
        defaults = {f.name: f.default for f in dataclasses.fields(RopeScaling)}
        changed = sorted(k for k, v in value.items() if k != "kind" and defaults.get(k) != v)
        if changed:
            _fail("rope_scaling.kind", None, f"name the scaling that {changed} configure")
        value = None
    if value is None or isinstance(value, RopeScaling):
        scaling = value
    elif isinstance(value, dict):
        names = {f.name for f in dataclasses.fields(RopeScaling)}
        unknown = sorted(set(value) - names)
        if unknown or "kind" not in value:
            _fail("rope_scaling", value, f"a dict with 'kind' and fields of {sorted(names)}")
        lists = {k: tuple(value[k]) for k in ("short_factor", "long_factor") if value.get(k)}
        scaling = RopeScaling(**{**value, **lists})
    else:
        _fail("rope_scaling", value, "None or a dict such as {'kind': 'linear', 'factor': 4.0}")
    if scaling is not None:
        _check_rope_scaling(scaling)
    return scaling


def _check_rope_scaling(s: RopeScaling) -> None:
    if s.kind not in ROPE_SCALINGS:
        _fail("rope_scaling.kind", s.kind, f"use one of {list(ROPE_SCALINGS)}")
    if not (isinstance(s.factor, int | float) and s.factor > 0):
        _fail("rope_scaling.factor", s.factor, "a positive number (the context's stretch)")
    needs = _SCALING_FIELDS[s.kind]
    for name in set(_SCALING_FIELDS["yarn"] + _SCALING_FIELDS["longrope"]) - set(needs):
        default = RopeScaling.__dataclass_fields__[name].default
        if getattr(s, name) != default:
            _fail(f"rope_scaling.{name}", getattr(s, name), f"not read by kind={s.kind!r}")
    if "original_max_len" in needs:
        n = s.original_max_len
        if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
            _fail("rope_scaling.original_max_len", n, "the pretraining context, a positive int")
    if s.kind == "llama3" and not 0 < s.low_freq_factor < s.high_freq_factor:
        _fail("rope_scaling.low_freq_factor", s.low_freq_factor, "in (0, high_freq_factor)")
    if s.kind == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = getattr(s, name)
            if not factors or not all(isinstance(f, int | float) and f > 0 for f in factors):
                _fail(f"rope_scaling.{name}", factors, "head_dim / 2 positive divisors")


def _check_rope(cfg) -> None:
    s = cfg.rope_scaling
    if s is None:
        return
    if cfg.position != "rope":
        _fail("rope_scaling", s, "scales RoPE: set position='rope' or rope_scaling=None")
    if s.kind == "longrope":
        half = (cfg.rotary_dim or cfg.head_dim) // 2
        for name in ("short_factor", "long_factor"):
            if len(getattr(s, name)) != half:
                _fail(f"rope_scaling.{name}", getattr(s, name), f"{half} factors (rotary dims / 2)")


def validate(cfg) -> None:
    """Raises ``ConfigError`` naming the offending field and the fix."""
    validate_raw(cfg)
    parametrization.check(cfg)
    _check_choices(cfg)
    _check_rope(cfg)
    _check_attention(cfg)
    _check_variants(cfg)
    _check_numbers(cfg)


def _check_choices(cfg) -> None:
    """Fields that name one of a fixed set, and the shapes those choices need."""
    _choice(cfg, "arch", ARCHS)
    _choice(cfg, "position", POSITIONS)
    _choice(cfg, "norm", NORMS)
    _choice(cfg, "norm_placement", NORM_PLACEMENTS)
    _choice(cfg, "qk_norm_scope", ("head", "projection"))
    if architecture(cfg).seq2seq and cfg.norm_placement not in ("pre", "post"):
        _fail("norm_placement", cfg.norm_placement, "encoder_decoder takes 'pre' or 'post'")
    rd = cfg.rotary_dim
    if rd is not None and not (isinstance(rd, int) and 0 < rd <= cfg.head_dim and rd % 2 == 0):
        _fail("rotary_dim", rd, f"an even number of head dims in (0, head_dim={cfg.head_dim}]")
    cap = cfg.logits_softcap
    if cap is not None and not (isinstance(cap, int | float) and 0 < cap < float("inf")):
        _fail("logits_softcap", cap, "a positive number (Gemma 2 uses 30.0), or None")
    _choice(cfg, "ffn", FFN_KINDS)
    if cfg.ffn in ACTIVATION_PARAMETERS and cfg.ffn_variant != "dense":
        _fail(
            "ffn",
            cfg.ffn,
            f"its learned scalars live in the dense FFN: set ffn_variant='dense' "
            f"(is {cfg.ffn_variant!r}) or choose another activation",
        )
    _choice(cfg, "attention_impl", IMPLEMENTATIONS)
    _choice(cfg, "dtype", DTYPES)
    _choice(cfg, "param_dtype", DTYPES)
    _check_x64(cfg)
    _choice(cfg, "sinusoidal_layout", ("interleaved", "split"))
    _choice(cfg, "remat", REMAT)
    _choice(cfg, "decode_layers", DECODE_LAYERS)


def _check_x64(cfg) -> None:
    """float64 needs JAX's 64-bit mode, without which JAX silently computes in float32."""
    for field in ("dtype", "param_dtype"):
        if getattr(cfg, field) == "float64" and not jax.config.jax_enable_x64:
            _fail(
                field,
                "float64",
                "float64 needs JAX's 64-bit mode: set JAX_ENABLE_X64=1 before starting Python, "
                "or call jax.config.update('jax_enable_x64', True) first",
            )


def _check_attention(cfg) -> None:
    """The attention implementation, context parallelism and the layers' windows."""
    for field in ("attention_block_q", "attention_block_k"):
        value = getattr(cfg, field)
        if value is not None and cfg.attention_impl not in BLOCKWISE:
            _fail(
                field,
                value,
                f"block sizes apply to the blockwise attention_impl {BLOCKWISE} only; set one "
                "or None",
            )
    if cfg.attention_impl in BLOCKWISE and cfg.attention_dropout > 0:
        _fail(
            "attention_dropout",
            cfg.attention_dropout,
            f"attention_impl={cfg.attention_impl!r} has no attention dropout: set it to 0, or "
            "use attention_impl='reference'",
        )
    _choice(cfg, "context_parallel", CONTEXT_PARALLEL)
    if not isinstance(cfg.context_load_balance, bool):
        _fail("context_load_balance", cfg.context_load_balance, "must be True or False")
    if not isinstance(cfg.scan_layers, bool):
        _fail("scan_layers", cfg.scan_layers, "must be True (lax.scan) or False (unrolled)")
    mtp = cfg.mtp_depth
    if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
        _fail("mtp_depth", mtp, "must be an integer >= 0 (0: no multi-token prediction)")
    if mtp and (cfg.arch != "decoder" or not cfg.causal):
        _fail("mtp_depth", mtp, "predicts ahead with a causal decoder: use arch='decoder', or 0")
    chosen = cfg.sliding_window_layers
    if chosen is not None:
        if cfg.sliding_window is None:
            _fail("sliding_window_layers", chosen, "set sliding_window too, or leave it None")
        n = max(cfg.n_layers, cfg.n_decoder_layers)
        if not all(isinstance(i, int) and 0 <= i < n for i in chosen):
            _fail("sliding_window_layers", chosen, f"list layer indices in [0, {n})")
    if cfg.layer_pattern is not None:
        if cfg.sliding_window is not None or cfg.sliding_window_layers is not None:
            _fail(
                "layer_pattern",
                cfg.layer_pattern,
                "it sets each layer's window: leave sliding_window and sliding_window_layers None",
            )
        for spec in cfg.layer_pattern:
            if spec.window is not None and (not isinstance(spec.window, int) or spec.window < 1):
                _fail("layer_pattern", spec, "a window must be a positive integer or None")
            if spec.rope_theta is not None and spec.rope_theta <= 0:
                _fail("layer_pattern", spec, "a rope_theta must be positive or None")
            if not isinstance(spec.rope, bool):
                _fail("layer_pattern", spec, "rope must be True or False (False: a NoPE layer)")
            if not spec.rope and cfg.position != "rope":
                _fail(
                    "layer_pattern",
                    spec,
                    "rope=False turns RoPE off in a layer: set position='rope'",
                )
        if not architecture(cfg).generates and any(s.window is not None for s in cfg.layer_pattern):
            _fail("layer_pattern", cfg.layer_pattern, "sliding windows are causal: decoders only")


def _check_variants(cfg) -> None:
    """The registered mixer, FFN and score function, and their own settings."""
    if not isinstance(cfg.mixer_settings, get_mixer(cfg.mixer).Settings):
        _fail("mixer_settings", cfg.mixer_settings, f"settings of mixer={cfg.mixer!r}")
    cfg.mixer_settings.validate(cfg)
    if not isinstance(cfg.ffn_settings, get_ffn(cfg.ffn_variant).Settings):
        _fail("ffn_settings", cfg.ffn_settings, f"settings of ffn_variant={cfg.ffn_variant!r}")
    cfg.ffn_settings.validate(cfg)
    if cfg.block_pattern is not None:
        cfg.block_pattern.validate(cfg)
    if cfg.attention_fn not in attention_variants():
        _fail(
            "attention_fn",
            cfg.attention_fn,
            f"register it with attnlab.nn.register_attention first; known: "
            f"{sorted(attention_variants())}",
        )


def _check_numbers(cfg) -> None:
    """Sizes, rates and ids in their domains; what the architecture rules out."""
    if cfg.n_heads % cfg.n_kv_heads:
        _fail(
            "n_kv_heads",
            cfg.n_kv_heads,
            f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads (use a divisor of it)",
        )
    if cfg.position == "rope" and cfg.head_dim % 2:
        _fail("head_dim", cfg.head_dim, "RoPE rotates pairs, so the head dim must be even")
    if cfg.position == "sinusoidal" and cfg.d_model % 2:
        _fail("d_model", cfg.d_model, "sinusoidal positions need an even d_model")
    if cfg.rope_theta <= 0:
        _fail("rope_theta", cfg.rope_theta, "must be positive")
    if cfg.position_offset < 0:
        _fail("position_offset", cfg.position_offset, "must be >= 0")
    if cfg.relative_buckets < 2 or cfg.relative_max_distance < 1:
        _fail(
            "relative_buckets",
            cfg.relative_buckets,
            "need relative_buckets >= 2 and relative_max_distance >= 1",
        )
    for field in ("dropout", "attention_dropout"):
        value = getattr(cfg, field)
        if not 0.0 <= value < 1.0:
            _fail(field, value, "a dropout rate must lie in [0, 1)")
    if cfg.norm_eps <= 0:
        _fail("norm_eps", cfg.norm_eps, "must be positive")
    if cfg.init_std <= 0:
        _fail("init_std", cfg.init_std, "must be positive")
    if not 0 <= cfg.pad_id < cfg.vocab_size:
        _fail("pad_id", cfg.pad_id, f"must be a token id in [0, vocab_size={cfg.vocab_size})")
    if cfg.type_vocab_size < 0:
        _fail("type_vocab_size", cfg.type_vocab_size, "must be >= 0 (0 = no token types)")
    arch = architecture(cfg)
    if arch.bidirectional and not cfg.causal:
        _fail("causal", cfg.causal, "only decoder-only models take causal=False (an ablation)")
    if not arch.generates and cfg.sliding_window is not None:
        _fail("sliding_window", cfg.sliding_window, "sliding windows are causal: decoders only")
