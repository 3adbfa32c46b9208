"""The built-in variants ``differential`` and ``mla`` (``attnlab.nn.mixers``): one layer
equals its float64 reference from the papers' equations (``tests/reference.py``), in
training and cached-decode modes; cached decoding equals recomputation in both
architectures that decode; gradients stay finite with fully masked rows; bad settings are
one-line errors naming the field; MLA's cache holds the latent and the rope keys alone, and
``kv_cache_bytes`` gives DeepSeek-V3's figure from the config."""

import math

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import reference
from flax import nnx

import attnlab
from attnlab import ModelConfig, init_cache
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.kv_cache import LayerCache
from attnlab.ops import MaskSpec

TINY = dict(mixer_checks.TINY, position="rope")
DIFF = dict(TINY, mixer="differential", n_kv_heads=2)  # GQA: two q heads per kv head
MLA_SETTINGS = dict(
    kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5
)
MLA = dict(TINY, mixer="mla", mixer_settings=MLA_SETTINGS)
B, T = 2, 6


def layer_mixer(cfg, seed=0):
    """``(mixer, params)``: one self-attention layer of the configured variant, called
    through ``jax.jit`` (one compilation rather than one per operation)."""
    attn = get_mixer(cfg.mixer)(cfg, cfg.mixer_settings, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(attn)
    apply = jax.jit(lambda params, x_BTD, call: nnx.merge(graphdef, params)(x_BTD, call))
    return (lambda x_BTD, call: apply(params, x_BTD, call)), params


def inputs(cfg, T=T, seed=0):
    x_BTD = jax.random.normal(jax.random.key(seed), (B, T, cfg.d_model))
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    return x_BTD, positions_BT


def close(got, want, rel=1e-5):
    """Equal to ``rel`` of the reference's largest magnitude (float32 against float64)."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=rel, atol=rel * np.abs(want).max())


def diff_params(params):
    p = {k: params[k][...] for k in ("q_DNH", "k_DKH", "v_DKH", "o_NHD")}
    for name in ("q1", "k1", "q2", "k2"):
        p[f"lambda_{name}"] = params[f"lambda_{name}_H"][...]
    p["norm_H"] = params["head_norm"]["scale_D"][...]
    return p


def mla_params(params):
    names = ("q_DNH", "q_down_DR", "q_up_RNH", "kv_down_DR", "k_rope_DH", "k_up_RNH",
             "v_up_RNH", "o_NHD")  # fmt: skip
    p = {k: params[k][...] for k in names if k in params}
    p["kv_norm_R"] = params["kv_norm"]["scale_D"][...]
    if "q_norm" in params:
        p["q_norm_R"] = params["q_norm"]["scale_D"][...]
    return p


@pytest.mark.parametrize(
    "impl, return_weights", [("auto", False), ("auto", True), ("chunked", False)]
)
def test_differential_layer_equals_the_reference(impl, return_weights):
    cfg = ModelConfig(
        **DIFF, attention_impl=impl, attention_block_q=4 if impl == "chunked" else None
    )
    attn, params = layer_mixer(cfg)
    x_BTD, positions_BT = inputs(cfg)
    # Row 1's first key is padding: its first query has no key at all (a zero row).
    valid_BS = jnp.arange(T)[None, :] >= jnp.array([[0], [1]])
    mask = MaskSpec.for_sequence(T, causal=True, k_valid=valid_BS)
    call = MixerCall(positions_BT=positions_BT, mask=mask, layer=jnp.int32(2),
                     return_weights=return_weights)  # fmt: skip
    out_BTD, cache, weights_BNTS = attn(x_BTD, call)
    assert cache is None
    mask_BTS = np.tril(np.ones((T, T), bool))[None] & np.asarray(valid_BS)[:, None, :]
    want_BTD, want_BNTS = reference.differential_attention(
        x_BTD, diff_params(params), lambda_init=0.8 - 0.6 * math.exp(-0.3 * 2),
        mask=mask_BTS, positions_BT=positions_BT, theta=cfg.rope_theta, eps=cfg.norm_eps,
    )  # fmt: skip
    close(out_BTD, want_BTD)
    np.testing.assert_array_equal(np.asarray(out_BTD)[1, 0], 0.0)
    if return_weights:
        close(weights_BNTS, want_BNTS)


@pytest.mark.parametrize(
    "settings",
    [MLA_SETTINGS, dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=9)],
    ids=["q_lora,v_narrow", "no_q_lora,v_wide"],
)
@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_mla_layer_equals_the_reference(settings, impl):
    chunked = dict(attention_impl="chunked", attention_block_q=4) if impl == "chunked" else {}
    cfg = ModelConfig(**{**MLA, "mixer_settings": settings, **chunked})
    attn, params = layer_mixer(cfg)
    x_BTD, positions_BT = inputs(cfg)
    valid_BS = jnp.arange(T)[None, :] >= jnp.array([[0], [1]])
    mask = MaskSpec.for_sequence(T, causal=True, k_valid=valid_BS)
    out_BTD, _, _ = attn(x_BTD, MixerCall(positions_BT=positions_BT, mask=mask))
    mask_BTS = np.tril(np.ones((T, T), bool))[None] & np.asarray(valid_BS)[:, None, :]
    want_BTD, _, _ = reference.latent_attention(
        x_BTD, mla_params(params), mask=mask_BTS, positions_BT=positions_BT,
        theta=cfg.rope_theta, eps=cfg.norm_eps,
    )  # fmt: skip
    close(out_BTD, want_BTD)


def test_mla_cache_holds_the_latent_and_rope_keys_and_a_step_absorbs_the_weights():
    cfg = ModelConfig(**MLA)
    S = 8
    cache = init_cache(cfg, B, S)
    L = cfg.n_layers
    assert {n: a.shape for n, a in cache.layers.items()} == {
        "latent": (L, B, S, 12),
        "rope_keys": (L, B, S, 4),
    }
    assert attnlab.kv_cache_bytes(cfg, B, S, "float32") == sum(
        a.nbytes for a in cache.layers.values()
    )
    attn, params = layer_mixer(cfg)
    x_BTD, positions_BT = inputs(cfg, T=T + 1)
    want_BTD, c_BTR, k_rope_BTH = reference.latent_attention(
        x_BTD, mla_params(params), mask=np.tril(np.ones((T + 1, T + 1), bool)),
        positions_BT=positions_BT, theta=cfg.rope_theta, eps=cfg.norm_eps,
    )  # fmt: skip

    def run(cache, start, x_BTD):
        n = x_BTD.shape[1]
        start_B = jnp.full((B,), start, jnp.int32)
        view = LayerCache(cache.layers, jnp.int32(0), start_B, jnp.full((B,), n, jnp.int32),
                          None, cache.slot_axes)  # fmt: skip
        call = MixerCall(positions_BT=positions_BT[:, start : start + n],
                         mask=MaskSpec.for_cache(n, S, start_B), cache=view)  # fmt: skip
        out_BTD, view, _ = attn(x_BTD, call)
        return out_BTD, cache.replace(layers=view.layers, lengths=start_B + n)

    out_BTD, cache = run(cache, 0, x_BTD[:, :T])  # prefill: keys and values up-projected
    close(out_BTD, want_BTD[:, :T])
    close(cache.layers["latent"][0, :, :T], c_BTR[:, :T])
    close(cache.layers["rope_keys"][0, :, :T], k_rope_BTH[:, :T])
    out_B1D, cache = run(cache, T, x_BTD[:, T:])  # one step: the weight-absorbed form
    close(out_B1D, want_BTD[:, T:])
    close(cache.layers["latent"][0, :, T], c_BTR[:, T])


def test_mla_cache_bytes_are_deepseek_v3s_from_the_config_alone():
    cfg = ModelConfig(
        vocab_size=129_280, d_model=7168, n_heads=128, n_layers=61, d_ff=18_432, max_len=4096,
        position="rope", norm="rmsnorm", mixer="mla",
        mixer_settings=dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128),
    )  # fmt: skip
    entries = attnlab.kv_cache.cache_entries(cfg)
    assert set(entries) == {"latent", "rope_keys"}
    assert sum(math.prod(e.sized(1)) for e in entries.values()) == 576  # per token and layer
    assert attnlab.kv_cache_bytes(cfg, 1, 1, "bfloat16") == 70_272  # 576 * 2 bytes * 61
    assert attnlab.kv_cache_bytes(cfg, 1, 4096, "bfloat16") == 70_272 * 4096


SEQ2SEQ = dict(n_layers=1, n_decoder_layers=2, arch="encoder_decoder")


SEQ2SEQ_SLOW = pytest.mark.slow(
    reason="an encoder-decoder compiles two stacks; the decoders cover the mixers"
)


@pytest.mark.parametrize(
    "base",
    [
        pytest.param(DIFF, id="differential"),
        pytest.param(MLA, id="mla"),
        pytest.param(
            dict(DIFF, mixer_settings={"lambda_init": 0.5}, **SEQ2SEQ),
            id="differential-encoder_decoder",
            marks=SEQ2SEQ_SLOW,
        ),
        pytest.param(dict(MLA, **SEQ2SEQ), id="mla-encoder_decoder", marks=SEQ2SEQ_SLOW),
    ],
)
def test_cached_decoding_equals_the_forward_pass(base):
    """Ragged prompts prefilled, then decoded token by token (MLA: the absorbed form)."""
    mixer_checks.prefill_then_steps(ModelConfig(**base))


ONE_SLOW = pytest.mark.slow(reason="MLA's case covers the same check in the fast tier")


@pytest.mark.parametrize(
    "base", [pytest.param(DIFF, id="differential", marks=ONE_SLOW), pytest.param(MLA, id="mla")]
)
def test_generation_with_the_cache_equals_recomputation(base):
    mixer_checks.generate_matches_recompute(ModelConfig(**base))


@pytest.mark.parametrize(
    "base", [pytest.param(DIFF, id="differential", marks=ONE_SLOW), pytest.param(MLA, id="mla")]
)
def test_gradients_are_finite_with_fully_masked_rows(base):
    mixer_checks.grads_finite_with_masked_rows(ModelConfig(**base))


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(MLA, mixer_settings={"kv_lora_rank": 64}), "mixer_settings.kv_lora_rank"),
        (dict(MLA, mixer_settings={"q_lora_rank": 0}), "mixer_settings.q_lora_rank"),
        (dict(MLA, mixer_settings={"qk_rope_head_dim": 3}), "mixer_settings.qk_rope_head_dim"),
        (dict(MLA, qk_norm=True), "ModelConfig.qk_norm"),
        (dict(DIFF, mixer_settings={"lambda_init": 1.5}), "mixer_settings.lambda_init"),
        (dict(DIFF, head_dim=6), "ModelConfig.head_dim"),
        (dict(DIFF, mixer_settings={"lambda": 0.5}), "mixer_settings has unknown field"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, field):
    mixer_checks.one_line_config_error([field], **changes)
