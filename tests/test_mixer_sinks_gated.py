"""Attention sinks (``mixer="sinks"``), gated attention (``mixer="gated"``) and logit
soft-capping (``ops.dot_product_attention(softcap=...)``, ``mha``'s ``softcap`` setting).

The ops are checked against the float64 formulas of ``tests/reference.py`` on the reference,
chunked and one-query paths, and the chunked path's custom backward against ``jax.grad`` of
the reference path; each variant's layer against the float64 layer; then the checks every
variant passes (``mixer_checks``): cached decoding equals recomputation, for decoders and
encoder-decoders, and gradients stay finite over fully masked rows.
"""

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import reference as ref
from flax import nnx

from attnlab import ModelConfig, ops
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.devices.sharding import logical_names
from attnlab.errors import ConfigError
from attnlab.ops import dot_product_attention

B, T, N, K, H = 2, 13, 4, 2, 8
TOL = {"rtol": 1e-5, "atol": 1e-6}
BLOCKS = dict(block_q=4, block_k=8)  # several blocks, lengths that do not divide them
SINKS_N = jnp.array([-1.0, 0.0, 0.5, 2.0], jnp.float32)
SOFTMAX = {
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=SINKS_N),
    "both": dict(softcap=1.5, sinks=SINKS_N),
}


def _qkv(seed, T=T, S=T):
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))
    return tuple(jnp.asarray(2.0 * rng.standard_normal(s), jnp.float32) for s in shapes)


def _mask(T=T, S=T):
    """Causal; row 1 sees its first 9 keys and its query 11 none (a fully masked row)."""
    mask = np.tril(np.ones((T, S), bool))[None, None].repeat(B, 0)
    mask[1, :, :, 9:] = False
    mask[1, :, 11] = False
    return jnp.asarray(mask)


def _ref(q, k, v, mask, *, bias=None, softcap=None, sinks=None):
    return ref.attention_capped_sinks(q, k, v, mask=mask, bias=bias, softcap=softcap,
                                      sinks_N=sinks)[0]  # fmt: skip


@pytest.mark.parametrize(
    ("implementation", "softmax"),
    [(i, s) for i in ("reference", "chunked") for s in SOFTMAX] + [("xla", "both")],
)
def test_ops_match_float64_reference(implementation, softmax):
    """Every implementation (xla falls back to the reference) equals the float64 formula,
    a fully masked row's output included (zero)."""
    q, k, v, _ = _qkv(0)
    mask, kw = _mask(), SOFTMAX[softmax]
    blocks = BLOCKS if implementation == "chunked" else {}
    fn = jax.jit(lambda q, k, v: dot_product_attention(
        q, k, v, mask=mask, implementation=implementation, **blocks, **kw))  # fmt: skip
    got = np.asarray(fn(q, k, v))
    want = _ref(q, k, v, mask, **kw)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.all(got[1, 11] == 0.0)


def test_sinks_take_weight_without_a_value():
    """With sinks the real keys' weights sum to sigmoid(lse - sink) < 1; a sink far below
    every logit changes nothing, one far above silences the head."""
    q, k, v, _ = _qkv(1)
    mask = _mask()
    out, w = dot_product_attention(q, k, v, mask=mask, sinks=SINKS_N, return_weights=True)
    _, want_w = ref.attention_capped_sinks(q, k, v, mask=mask, sinks_N=SINKS_N)
    np.testing.assert_allclose(np.asarray(w), want_w, **TOL)
    assert np.all(np.asarray(w).sum(-1) < 1.0)
    plain = dot_product_attention(q, k, v, mask=mask)
    low = dot_product_attention(q, k, v, mask=mask, sinks=jnp.full((N,), -1e4))
    high = dot_product_attention(q, k, v, mask=mask, sinks=jnp.full((N,), 1e4))
    np.testing.assert_allclose(np.asarray(low), np.asarray(plain), **TOL)
    assert np.abs(np.asarray(high)).max() == 0.0


@pytest.mark.parametrize("softmax", SOFTMAX)
def test_chunked_gradients_match_the_reference_path(softmax):
    """The chunked custom backward (the cap's 1 - tanh^2, the sinks' lse cotangent) equals
    jax.grad of the reference path for q, k, v, a dense bias and the sinks; a fully masked
    row contributes zero."""
    q, k, v, w = _qkv(2)
    mask = _mask()
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((1, N, T, T)), jnp.float32)
    kw = dict(SOFTMAX[softmax])
    sinks = kw.pop("sinks", None)

    def loss(implementation, q, k, v, bias, sinks):
        blocks = BLOCKS if implementation == "chunked" else {}
        out = dot_product_attention(q, k, v, mask=mask, bias=bias, sinks=sinks,
                                    implementation=implementation, **blocks, **kw)  # fmt: skip
        return jnp.sum(out * w)

    args = (q, k, v, bias, sinks)
    argnums = (0, 1, 2, 3, 4) if sinks is not None else (0, 1, 2, 3)
    grads = {
        impl: jax.jit(jax.grad(lambda *a, impl=impl: loss(impl, *a), argnums))(*args)
        for impl in ("reference", "chunked")
    }
    for got, want in zip(grads["chunked"], grads["reference"], strict=True):
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads["chunked"][0][1, 11]), 0.0)


def test_one_query_path_and_validation():
    """A decoding step (one query, ``"auto"`` on CPU) caps and sinks like the formula; the
    chunked path names a bad cap and a sink vector of the wrong length."""
    q, k, v, _ = _qkv(4, T=1)
    mask = jnp.asarray(np.arange(T)[None, None, None, :] < np.array([T, 0])[:, None, None, None])
    kw = SOFTMAX["both"]
    got = jax.jit(lambda q, k, v: dot_product_attention(
        q, k, v, mask=mask, implementation="auto", **kw))(q, k, v)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), _ref(q, k, v, mask, **kw), **TOL)
    with pytest.raises(ValueError, match="softcap=-1.0 must be positive"):
        dot_product_attention(q, k, v, softcap=-1.0, implementation="chunked")
    with pytest.raises(ValueError, match="one logit per query head"):
        dot_product_attention(q, k, v, sinks=jnp.zeros(3), implementation="chunked")


# The variants as layers and in models.

TINY = dict(mixer_checks.TINY, position="rope", n_kv_heads=2)
VARIANTS = {
    "sinks": ("sinks", {"init": 0.5}),
    "gated_headwise": ("gated", {"kind": "headwise"}),
    "gated_elementwise": ("gated", {"kind": "elementwise", "softcap": 3.0}),
    "mha_softcap": ("mha", {"softcap": 2.0}),
}


def _cfg(variant, **changes):
    mixer, settings = VARIANTS[variant]
    return ModelConfig(**{**TINY, **changes}, mixer=mixer, mixer_settings=settings)


@pytest.mark.parametrize("implementation", ["auto", "chunked"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_matches_float64_reference(variant, implementation):
    """One self-attention layer (RoPE, GQA, a padded row) equals the float64 layer written
    from the papers' equations, on the dense and the chunked path."""
    blocks = dict(attention_block_q=4, attention_block_k=8) if implementation == "chunked" else {}
    cfg = _cfg(variant, attention_impl=implementation, **blocks)
    layer = get_mixer(cfg.mixer)(cfg, cfg.mixer_settings, rngs=nnx.Rngs(0))
    if hasattr(layer, "sinks_N"):
        layer.sinks_N[...] = SINKS_N
    rng = np.random.default_rng(5)
    x_BTD = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), jnp.float32)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid_BT = jnp.asarray(np.arange(T)[None, :] < np.array([[T], [9]]))
    mask = ops.MaskSpec.for_sequence(T, causal=True, k_valid=valid_BT)
    got = jax.jit(lambda x: layer(x, MixerCall(positions_BT=positions_BT, mask=mask))[0])(x_BTD)
    settings = cfg.mixer_settings
    gate = getattr(layer, "gate_DN", None) or getattr(layer, "gate_DNH", None)
    want = ref.attention_layer(
        x_BTD, layer.q_DNH[...], layer.k_DKH[...], layer.v_DKH[...], layer.o_NHD[...],
        positions_BT=positions_BT, rope_theta=cfg.rope_theta, mask=mask.dense(),
        softcap=settings.softcap, sinks_N=getattr(layer, "sinks_N", None),
        gate=None if gate is None else gate[...],
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_parameters_name_their_axes():
    """The variants' parameters carry shape suffixes the mesh rules read."""
    for variant, name, axes in (
        ("sinks", "sinks_N", ("heads",)),
        ("gated_headwise", "gate_DN", ("embed", "heads")),
        ("gated_elementwise", "gate_DNH", ("embed", "heads", "head_dim")),
    ):
        cfg = _cfg(variant)
        layer = get_mixer(cfg.mixer)(cfg, cfg.mixer_settings, rngs=nnx.Rngs(0))
        leaf = getattr(layer, name)
        assert logical_names([jax.tree_util.DictKey(name)], leaf.shape) == axes
        others = {"gate_DN", "gate_DNH"} - {name}
        assert all(getattr(layer, o, None) is None for o in others)


ENC_DEC = {"arch": "encoder_decoder", "n_layers": 1, "n_decoder_layers": 2}
CHUNKED = {"attention_impl": "chunked", "attention_block_q": 4, "attention_block_k": 4}
CHECK_CFGS = {
    "sinks-decoder": ("sinks", {}),
    "gated-encdec": ("gated_elementwise", ENC_DEC),  # the element-wise gate and the cap
    "sinks-encdec": ("sinks", ENC_DEC),
    "gated-decoder": ("gated_headwise", {}),
    # The cap on the chunked path inside a model, prefill and decode steps alike.
    "softcap-decoder-chunked": ("mha_softcap", CHUNKED),
}
# Each case compiles a model's forward, prefill and decode step, or its gradient (10-20 s
# of CPU time each; the chunked path's loops compile slowest): the fast tier keeps one
# decoder and one encoder-decoder, which cover sinks, the gate and the cap, and leaves the
# chunked path to the op tests above; the slow tier runs the rest.
SLOW = pytest.mark.slow(reason="more model compilations of cases the fast tier covers")


def _cases(*fast, slow=()):
    return [*fast, *(pytest.param(c, marks=SLOW) for c in slow)]


@pytest.mark.parametrize(
    "case",
    _cases("sinks-decoder", "gated-encdec",
           slow=("sinks-encdec", "gated-decoder", "softcap-decoder-chunked")),
)  # fmt: skip
def test_cached_decode_matches_recompute(case):
    variant, changes = CHECK_CFGS[case]
    mixer_checks.prefill_then_steps(_cfg(variant, **changes))


# Generation (decoders: ``generate_matches_recompute`` passes no encoder-decoder start id)
# compiles the sampling loop twice over; the cache itself is checked above.
@pytest.mark.parametrize("case", _cases(slow=("sinks-decoder", "gated-decoder")))
def test_generation_matches_recompute(case):
    variant, changes = CHECK_CFGS[case]
    mixer_checks.generate_matches_recompute(_cfg(variant, **changes))


@pytest.mark.parametrize(
    "case", _cases("sinks-decoder", slow=("gated-decoder", "softcap-decoder-chunked"))
)
def test_gradients_finite_with_fully_masked_rows(case):
    variant, changes = CHECK_CFGS[case]
    mixer_checks.grads_finite_with_masked_rows(_cfg(variant, **changes))


@pytest.mark.parametrize(
    ("mixer", "settings", "field"),
    [
        ("gated", {"kind": "rowwise"}, "kind"),
        ("gated", {"softcap": 0.0}, "softcap"),
        ("mha", {"softcap": -50.0}, "softcap"),
        ("mha", {"softcap": "50"}, "softcap"),
        ("sinks", {"init": float("nan")}, "init"),
    ],
)
def test_bad_settings_give_one_line_errors_naming_the_field(mixer, settings, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**TINY, mixer=mixer, mixer_settings=settings)
    message = str(info.value)
    assert f"mixer_settings.{field}=" in message and "\n" not in message
