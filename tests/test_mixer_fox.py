"""The Forgetting Transformer (``mixer="fox"``) against its float64 formula, with gradients;
cached decoding equals recomputation (fully masked rows: the op's own tests,
``test_ops_flex.py``; a mesh run against one device: ``test_mixer_mesh.py``).

``reference.forgetting_attention`` writes the paper's decay as the explicit sum of the log
forget gates between key and query; the layer is checked against it on the chunked path
(blocks smaller than T) and on the reference path, and the gradient of the forget gate's
parameters through the chunked path's custom backward against the reference path's.
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
from attnlab.errors import ConfigError

B, T = 2, 11
TINY = dict(mixer_checks.TINY, n_kv_heads=2, position="none", mixer="fox")
CHUNKED = dict(attention_impl="chunked", attention_block_q=4, attention_block_k=8)


def _layer(**changes):
    cfg = ModelConfig(**{**TINY, **changes}, mixer_settings={"bias_init": 1.0})
    layer = get_mixer("fox")(cfg, cfg.mixer_settings, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    layer.fgate_bias_N[...] = jnp.asarray(rng.uniform(-1, 3, cfg.n_heads), jnp.float32)
    x_BTD = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), jnp.float32)
    return cfg, layer, x_BTD


def _call():
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return MixerCall(positions_BT=positions_BT, mask=ops.MaskSpec.for_sequence(T, causal=True))


def _f64_layer(layer, x_BTD):
    """The layer from its parameters, in float64: projections, gates, attention, output."""
    p = {n: np.asarray(getattr(layer, n)[...], np.float64)
         for n in ("q_DNH", "k_DKH", "v_DKH", "o_NHD", "fgate_DN", "fgate_bias_N")}  # fmt: skip
    x = np.asarray(x_BTD, np.float64)
    q, k, v = (np.einsum("BTD,DNH->BTNH", x, p[n]) for n in ("q_DNH", "k_DKH", "v_DKH"))
    logf_BTN = np.log(ref.sigmoid(np.einsum("BTD,DN->BTN", x, p["fgate_DN"]) + p["fgate_bias_N"]))
    heads_BTNH = ref.forgetting_attention(q, k, v, logf_BTN)
    return np.einsum("BTNH,NHD->BTD", heads_BTNH, p["o_NHD"])


def test_fox_layer_equals_its_float64_formula():
    """On the chunked path, blocks of 4 x 8 over T = 11 (GQA, no positions: FoX needs none)."""
    _, layer, x_BTD = _layer(**CHUNKED)
    call = _call()
    got = jax.jit(lambda x: layer(x, call)[0])(x_BTD)
    np.testing.assert_allclose(np.asarray(got), _f64_layer(layer, x_BTD), rtol=1e-5, atol=2e-5)


@pytest.mark.slow(reason="compiles the layer's gradient on two paths")
def test_fox_gradients_of_the_gate_match_the_reference_path():
    """The chunked path's custom backward returns the forget gate's gradient (through the
    score function's closed-over cumulative sums) as autodiff of the dense path does."""
    _, chunked_layer, x_BTD = _layer(**CHUNKED)
    _, dense_layer, _ = _layer(attention_impl="reference")
    call = _call()

    def loss(layer, x):
        return jnp.sum(layer(x, call)[0] ** 2)

    g_chunked = nnx.jit(nnx.grad(loss))(chunked_layer, x_BTD)
    g_dense = nnx.jit(nnx.grad(loss))(dense_layer, x_BTD)
    for name in ("fgate_DN", "fgate_bias_N", "q_DNH", "k_DKH", "v_DKH"):
        want = np.asarray(getattr(g_dense, name)[...])
        assert np.abs(want).max() > 1e-3, name  # the gate gets a gradient at all
        got = np.asarray(getattr(g_chunked, name)[...])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)  # fmt: skip


def test_fox_declares_its_cumulative_gate_as_a_cache_entry():
    cfg = ModelConfig(**TINY)
    entries = get_mixer("fox").cache_entries(cfg, cfg.mixer_settings)
    assert set(entries) == {"keys", "values", "log_forget"}
    assert entries["log_forget"].shape == (cfg.n_heads, -1)
    assert entries["log_forget"].dtype == "float32"


def test_fox_settings_are_validated():
    with pytest.raises(ConfigError, match=r"mixer_settings.bias_init"):
        ModelConfig(**TINY, mixer_settings={"bias_init": float("nan")})
    with pytest.raises(ConfigError, match=r"causal=False is invalid with mixer='fox'"):
        ModelConfig(**TINY, causal=False)


@pytest.mark.slow(reason="compiles a model's prefill, decode steps and forward pass")
def test_fox_cached_decoding_equals_recompute():
    cfg = ModelConfig(**TINY, mixer_settings={"bias_init": 1.0})
    mixer_checks.prefill_then_steps(cfg, atol=2e-5)  # ragged prefill, then token by token
