"""LoLCATs attention (``mixer="lolcats"``): the layer against a float64 NumPy loop over its
equations (sliding-window softmax + Hedgehog-feature linear attention over older tokens,
mixed by sigmoid(factor)), with and without a window and with GQA; a prefill followed by
token-by-token decoding equals one forward pass (ragged prompts, a window smaller than the
prompt); surgery from softmax attention keeps q/k/v/o; its fixed-size cache and bad
settings."""

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
from flax import nnx

from attnlab import ModelConfig, kv_cache_bytes
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.errors import ConfigError


def tiny(window=3, **changes):
    settings = {"window": window}
    return ModelConfig(**{**mixer_checks.TINY, "mixer": "lolcats", "mixer_settings": settings,
                          **changes})  # fmt: skip


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def lolcats_float64(x_BTD, layer, window):
    """Token by token in float64 from the layer's parameters (no positions)."""
    f = lambda p: np.asarray(p[...], np.float64)
    x = np.asarray(x_BTD, np.float64)
    q = np.einsum("btd,dnh->btnh", x, f(layer.q_DNH))
    k = np.einsum("btd,dkh->btkh", x, f(layer.k_DKH))
    v = np.einsum("btd,dkh->btkh", x, f(layer.v_DKH))
    N, K, H = q.shape[2], k.shape[2], q.shape[3]
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    phi = lambda y, w: np.concatenate(
        [softmax(np.einsum("nh,nhf->nf", y, w)), softmax(-np.einsum("nh,nhf->nf", y, w))], -1
    )
    wq, wk = f(layer.feature_q_NHF), f(layer.feature_k_NHF)
    g = 1 / (1 + np.exp(-f(layer.window_factor_N))) if window else np.zeros(N)
    Bsz, T = x.shape[:2]
    y = np.zeros((Bsz, T, N, H))
    for b in range(Bsz):
        for t in range(T):
            for n in range(N):
                win = [s for s in range(t + 1) if t - s < window]
                lin = [s for s in range(t + 1) if t - s >= window]
                num, den = np.zeros(H), 0.0
                if win:
                    sc = np.array([q[b, t, n] @ k[b, s, n] * H**-0.5 for s in win])
                    a = g[n] * np.exp(sc - sc.max())
                    num += a @ v[b, win, n]
                    den += a.sum()
                fq = phi(q[b, t], wq)[n]
                for s in lin:
                    w = (1 - g[n]) * fq @ phi(k[b, s], wk)[n]
                    num += w * v[b, s, n]
                    den += w
                y[b, t, n] = num / den
    return np.einsum("btnh,nhd->btd", y, f(layer.o_NHD))


@pytest.mark.parametrize("window, kv_heads, feature_dim", [(3, 4, 0), (0, 4, 0), (2, 2, 5)])
def test_the_layer_is_lolcats_attention_in_float64(window, kv_heads, feature_dim):
    cfg = tiny(window, n_kv_heads=kv_heads, position="none")
    cls = get_mixer("lolcats")
    layer = cls(cfg, cls.Settings(window=window, feature_dim=feature_dim, factor_init=0.3),
                rngs=nnx.Rngs(0))  # fmt: skip
    rng = np.random.default_rng(1)
    for name in ("feature_q_NHF", "feature_k_NHF"):  # away from the identity
        w = getattr(layer, name)
        w[...] = w[...] + jnp.asarray(0.3 * rng.normal(size=w.shape), jnp.float32)
    x = rng.normal(size=(2, 7, cfg.d_model)).astype(np.float32)
    call = MixerCall(positions_BT=jnp.tile(jnp.arange(7), (2, 1)))
    out, cache, weights = layer(jnp.asarray(x), call)
    want = lolcats_float64(x, layer, window)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert cache is None and weights is None


@pytest.mark.parametrize("window", [3, 0])
def test_prefill_then_steps_equal_one_forward_pass(window):
    """Ragged prompts of 3 and 6 tokens (longer than the window of 3), then one token at a
    time: every logit equals the full forward pass's (RoPE, GQA)."""
    mixer_checks.prefill_then_steps(tiny(window, n_kv_heads=2, position="rope"), atol=1e-5)


def test_surgery_from_attention_keeps_q_k_v_o_and_starts_new_maps_at_identity():
    from attnlab import build_model
    from attnlab.nn import surgery

    cfg = ModelConfig(**mixer_checks.TINY, position="rope")
    params = nnx.state(build_model(cfg, seed=1))
    new_cfg, new = surgery.replace_mixer(cfg, params, [1], "lolcats", {"window": 4},
                                         init="matching")  # fmt: skip
    old, got = nnx.to_pure_dict(params), nnx.to_pure_dict(new)
    stack_old, stack_new = old["decoder"], got["decoder"]
    layer_old = jax.tree.map(lambda a: np.asarray(a)[1], stack_old["layers"]["attn"])
    mixer_new = {k: np.asarray(v) for k, v in _mixer_of(stack_new, 1).items()}
    for name in ("q_DNH", "k_DKH", "v_DKH", "o_NHD"):
        np.testing.assert_array_equal(mixer_new[name], layer_old[name])
    np.testing.assert_array_equal(mixer_new["feature_q_NHF"][0], np.eye(cfg.head_dim))
    assert new_cfg.n_layers == 2


def _mixer_of(stack, i):
    """Layer ``i``'s mixer in a stack with one layer of each kind (prefix + block)."""
    for seg in stack.values():
        if isinstance(seg, dict) and "attn" in seg and "feature_q_NHF" in seg["attn"]:
            return {k: np.asarray(v)[0] for k, v in seg["attn"].items() if not isinstance(v, dict)}
        if isinstance(seg, dict) and "blocks" in seg:
            for blk in seg["blocks"].values():
                if "feature_q_NHF" in blk.get("attn", {}):
                    return {k: np.asarray(v)[0] for k, v in blk["attn"].items()
                            if not isinstance(v, dict)}  # fmt: skip
    raise AssertionError(list(stack))


def test_its_cache_is_fixed_size():
    cfg = tiny(4)
    entries = get_mixer("lolcats").cache_entries(cfg, get_mixer("lolcats").Settings(window=4))
    assert all(e.slot_axis is None for e in entries.values())
    small = kv_cache_bytes(cfg, 1, 16, "float32")
    assert kv_cache_bytes(cfg, 1, 4096, "float32") == small
    N, H, W = 4, 8, 4
    per_layer = (N * 2 * H * H + N * 2 * H) * 4 + 2 * W * N * H * 4
    assert small == 2 * per_layer


@pytest.mark.parametrize(
    "settings, field", [({"window": -1}, "window"), ({"feature_dim": 1.5}, "feature_dim")]
)
def test_bad_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=f"mixer_settings.{field}"):
        ModelConfig(**mixer_checks.TINY, mixer="lolcats", mixer_settings=settings)
