"""The recurrent-state mixers against transformers' own torch layers on the same random
weights: ``gated_deltanet`` against ``Qwen3NextGatedDeltaNet``, ``mamba2`` against
``Mamba2Mixer``, through the parameter mapping a checkpoint loader uses. Skipped without
transformers and torch (the ``hf`` extra)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_mixer_recurrent import (
    MIXERS,
    ONLY_GDN,
    SETTINGS,
    mixer_module,
    plain_call,
    prefill_then_steps,
    rel,
    tiny,
)


def _torch_layer(mixer, cfg):
    """transformers' own layer for ``cfg``'s settings (float64, random weights)."""
    pytest.importorskip("transformers", reason="transformers (and torch) hold the reference")
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    s = cfg.mixer_settings.resolved(cfg)
    common = dict(hidden_size=cfg.d_model, num_hidden_layers=1, hidden_act="silu")
    if mixer == "gated_deltanet":
        hf = transformers.Qwen3NextConfig(
            **common, linear_num_value_heads=s.num_v_heads, linear_num_key_heads=s.num_k_heads,
            linear_key_head_dim=s.head_k_dim, linear_value_head_dim=s.head_v_dim,
            linear_conv_kernel_dim=s.conv_kernel, rms_norm_eps=cfg.norm_eps,
            layer_types=["linear_attention"],
        )  # fmt: skip
        layer = Qwen3NextGatedDeltaNet(hf, layer_idx=0)
    else:
        hf = transformers.Mamba2Config(
            **common, num_heads=s.num_heads, head_dim=s.head_dim, state_size=s.state_size,
            n_groups=s.n_groups, expand=s.expand, conv_kernel=s.conv_kernel,
            chunk_size=s.chunk_size, use_conv_bias=s.use_conv_bias, use_bias=s.use_bias,
            layer_norm_epsilon=cfg.norm_eps,
        )  # fmt: skip
        layer = Mamba2Mixer(hf, layer_idx=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name == "A_log":
                p.copy_(torch.log(0.5 + 3 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("norm.weight") or name == "D":
                p.copy_(1 + 0.2 * r)
            else:
                p.copy_(0.3 * r)
    layer.hf_config = hf
    return layer.double().eval(), torch


def _copy_weights(mixer, layer, module, cfg):
    """transformers' parameters into ours: the name/shape mapping a checkpoint loader uses."""
    w = {n: jnp.asarray(p.detach().numpy(), jnp.float32) for n, p in layer.named_parameters()}
    D = cfg.d_model
    put = lambda name, value: setattr(module, name, nnx.Param(value))
    put("conv_WZ", w["conv1d.weight"][:, 0].T)
    put("A_log_N", w["A_log"])
    put("dt_bias_N", w["dt_bias"])
    if mixer == "gated_deltanet":
        K = module.settings.num_k_heads
        put("in_proj_qkvz_DKH", w["in_proj_qkvz.weight"].T.reshape(D, K, -1))
        put("in_proj_ba_DKH", w["in_proj_ba.weight"].T.reshape(D, K, -1))
        put("norm_scale_J", w["norm.weight"])
        N = module.settings.num_v_heads
        put("out_proj_NJD", w["out_proj.weight"].T.reshape(N, -1, D))
    else:
        put("in_proj_DZ", w["in_proj.weight"].T)
        put("conv_bias_Z", w["conv1d.bias"])
        put("D_N", w["D"])
        put("norm_scale_Z", w["norm.weight"])
        put("out_proj_ZD", w["out_proj.weight"].T)


def _against_transformers(mixer, form):
    """On the same random weights, 11 tokens (chunks of 4) and a left-padded row: our layer
    (in ``form``) equals transformers' ``Qwen3NextGatedDeltaNet`` /
    ``Mamba2Mixer`` (float64 weights and inputs; its kernels run the recurrence in float32),
    at every real position, to 1e-5 relative."""
    cfg = tiny(mixer, d_model=16, mixer_settings={**SETTINGS[mixer], "form": form})
    layer, torch = _torch_layer(mixer, cfg)
    module = mixer_module(cfg)
    _copy_weights(mixer, layer, module, cfg)
    B, T = 2, 11
    x = np.random.default_rng(2).normal(size=(B, T, cfg.d_model))
    valid = np.ones((B, T), bool)
    valid[1, :4] = False  # row 1 is left-padded
    with torch.no_grad():
        want = layer(torch.tensor(x), attention_mask=torch.tensor(valid, dtype=torch.long))
    want = want.numpy()
    call = plain_call(B, T, jnp.asarray(valid))
    graphdef, params = nnx.split(module)
    run = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x, call))
    got, cache, weights = run(params, jnp.asarray(x, jnp.float32))
    assert cache is None and weights is None
    assert rel(np.asarray(got)[valid], want[valid]) <= 1e-5


@pytest.mark.parametrize("mixer", ONLY_GDN)
def test_the_chunked_module_equals_transformers_torch_layer(mixer):
    _against_transformers(mixer, "chunked")


@pytest.mark.slow(reason="compiles the per-token scan of a layer the fast tier checks chunked")
@pytest.mark.parametrize("mixer", MIXERS)
def test_the_recurrent_module_equals_transformers_torch_layer(mixer):
    _against_transformers(mixer, "recurrent")


def _against_transformers_cached(mixer):
    """A prefill of 6 tokens with a cache, then 3 one-token steps, through transformers'
    ``DynamicCache`` (its recurrent-step kernels) and through ours: equal outputs to 1e-5
    relative, and equal caches: the state in the same layout, our conv entry transformers'
    last ``W - 1`` inputs (it keeps ``W``, channels first)."""
    from transformers.cache_utils import DynamicCache

    cfg = tiny(mixer, d_model=16, n_layers=1)
    layer, torch = _torch_layer(mixer, cfg)
    module = mixer_module(cfg)
    _copy_weights(mixer, layer, module, cfg)
    B, P, T = 2, 6, 9
    x = np.random.default_rng(3).normal(size=(B, T, cfg.d_model))
    hf_cache = DynamicCache(config=layer.hf_config)
    with torch.no_grad():
        want = [layer(torch.tensor(x[:, :P]), cache=hf_cache)]
        want += [layer(torch.tensor(x[:, t : t + 1]), cache=hf_cache) for t in range(P, T)]
    want = np.concatenate([w.numpy() for w in want], axis=1)
    got, entries = prefill_then_steps(module, cfg, jnp.asarray(x, jnp.float32), P)
    assert rel(got, want) <= 1e-5
    hf_state = hf_cache.get_recurrent_state(0).numpy()
    assert rel(entries["state"][0], hf_state) <= 1e-5
    hf_conv = hf_cache.get_conv_state(0).numpy()[:, :, 1:].transpose(0, 2, 1)
    assert rel(entries["conv"][0], hf_conv) <= 1e-6


@pytest.mark.slow(reason="the fast tier checks the steps against float64 and the layer here")
@pytest.mark.parametrize("mixer", MIXERS)
def test_prefill_and_steps_equal_transformers_cached_decoding(mixer):
    _against_transformers_cached(mixer)
