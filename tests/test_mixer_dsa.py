"""DeepSeek Sparse Attention (``mixer="dsa"``) against the DeepSeek-V3.2-Exp report's
equations in float64: the lightning indexer's scores, each query's top-k keys, MLA over
them alone, and the indexer's KL loss (dense and sparse forms); a prefill split anywhere and
continued, then a step, equals one pass; cached decoding equals the forward pass; the loss
trains the indexer alone; its cache and its settings' errors."""

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
from attnlab.errors import ConfigError
from attnlab.kv_cache import LayerCache
from attnlab.ops import MaskSpec

SETTINGS = dict(
    kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
    topk=3, index_heads=3, index_head_dim=6,
)  # fmt: skip
DSA = dict(mixer_checks.TINY, position="rope", mixer="dsa", mixer_settings=SETTINGS)
B, T = 2, 7
CHUNKED = dict(attention_impl="chunked", attention_block_q=4, attention_block_k=4)


def f64(a):
    return np.asarray(a, np.float64)


def float64_dsa(x_BTD, p, *, allowed_BTS, positions_BT, settings, theta, eps):
    """``(out_BTD, kept_BTS, logits_BNTS, scores_BTS)`` of the report's equations: the
    indexer's scores ``I = sum_n w_n ReLU(q_n . k / sqrt(Hi))`` (q from the compressed
    query, k LayerNorm-ed, the first ``Hr`` values of both rotated), the ``topk`` allowed
    keys of highest ``I`` per query, and MLA (``reference.latent_attention``) over them."""
    x = f64(x_BTD)
    s = settings
    Hr, J = s["qk_rope_head_dim"], s["index_heads"]
    c_q_BTR = reference.rms_norm(x @ p["q_down_DR"], p["q_norm_R"], eps=eps)
    q_BTNH = np.einsum("BTR,RNH->BTNH", c_q_BTR, p["index_q_RNH"])
    k_BTH = reference.layer_norm(x @ p["index_k_DH"], p["index_k_scale_H"],
                                 p["index_k_bias_H"], eps=1e-6)  # fmt: skip
    q_BTNH[..., :Hr] = reference.apply_rope(q_BTNH[..., :Hr], positions_BT, theta=theta)
    k_BTH[..., :Hr] = reference.apply_rope(k_BTH[:, :, None, :Hr], positions_BT, theta=theta)[
        :, :, 0
    ]
    w_BTN = x @ p["index_w_DN"] / math.sqrt(J)
    dots_BTNS = np.einsum("BTNH,BSH->BTNS", q_BTNH, k_BTH) / math.sqrt(q_BTNH.shape[-1])
    scores_BTS = np.einsum("BTN,BTNS->BTS", w_BTN, np.maximum(dots_BTNS, 0.0))
    kept_BTS = np.zeros_like(allowed_BTS)
    for b in range(B):
        for t in range(x.shape[1]):
            keys = np.flatnonzero(allowed_BTS[b, t])
            best = keys[np.argsort(-scores_BTS[b, t, keys], kind="stable")[: s["topk"]]]
            kept_BTS[b, t, best] = True
    out_BTD, c_BTR, k_rope_BTH = reference.latent_attention(
        x, p, mask=kept_BTS, positions_BT=positions_BT, theta=theta, eps=eps
    )
    # The main attention's logits per head, for the indexer's target.
    q_main_BTNH = np.einsum("BTR,RNH->BTNH", c_q_BTR, p["q_up_RNH"])
    Hn = q_main_BTNH.shape[-1] - Hr
    q_rope_BTNH = reference.apply_rope(q_main_BTNH[..., Hn:], positions_BT, theta=theta)
    k_nope_BSNH = np.einsum("BSR,RNH->BSNH", c_BTR, p["k_up_RNH"])
    logits_BNTS = (
        np.einsum("BTNH,BSNH->BNTS", q_main_BTNH[..., :Hn], k_nope_BSNH)
        + np.einsum("BTNH,BSH->BNTS", q_rope_BTNH, k_rope_BTH)
    ) / math.sqrt(Hn + Hr)
    return out_BTD, kept_BTS, logits_BNTS, scores_BTS


def float64_kl(logits_BNTS, scores_BTS, support_BTS):
    """Sum over queries of ``KL(p || softmax(I))`` over each query's support, ``p`` the
    heads' softmax weights summed and L1-normalised; and the queries with a support."""
    total, rows = 0.0, 0
    for b, t in np.ndindex(*support_BTS.shape[:2]):
        keys = support_BTS[b, t]
        if not keys.any():
            continue
        logits = logits_BNTS[b, :, t][:, keys]
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        p = (weights / weights.sum(-1, keepdims=True)).sum(0)
        p /= p.sum()
        i = scores_BTS[b, t, keys]
        log_q = i - i.max() - np.log(np.exp(i - i.max()).sum())
        total += float(np.sum(p * (np.log(p) - log_q)))
        rows += 1
    return total, rows


def layer_params(layer):
    names = ("q_down_DR", "q_up_RNH", "kv_down_DR", "k_rope_DH", "k_up_RNH", "v_up_RNH",
             "o_NHD", "index_q_RNH", "index_k_DH", "index_k_scale_H", "index_k_bias_H",
             "index_w_DN")  # fmt: skip
    p = {n: f64(getattr(layer, n)[...]) for n in names}
    p["q_norm_R"] = f64(layer.q_norm.scale_D[...])
    p["kv_norm_R"] = f64(layer.kv_norm.scale_D[...])
    return p


def make_layer(cfg, seed=0):
    layer = get_mixer("dsa")(cfg, cfg.mixer_settings, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)  # a LayerNorm with a scale and bias of its own
    layer.index_k_scale_H[...] = jnp.asarray(rng.uniform(0.5, 1.5, layer.index_k_scale_H.shape))
    layer.index_k_bias_H[...] = jnp.asarray(rng.normal(0, 0.3, layer.index_k_bias_H.shape))
    return layer


def sown_call(module, x_BTD, call):
    """The module's call and its sown indexer loss (None when it sowed none)."""
    out, sown = nnx.capture(lambda m, x, c: m(x, c), nnx.Intermediate)(module, x_BTD, call)
    found = [v.get_value()[0] for path, v in nnx.to_flat_state(sown) if path[-1] == "indexer_kl"]
    return out, (found[0] if found else None)


def run_layer(layer, x_BTD, call):
    """``(out_BTD, cache, indexer_kl)``: the layer's call under ``jax.jit`` and what it
    sowed."""
    graphdef, params = nnx.split(layer)

    @jax.jit
    def apply(params, x_BTD, call):
        (out_BTD, cache, _), kl = sown_call(nnx.merge(graphdef, params), x_BTD, call)
        return out_BTD, cache, kl

    return apply(params, x_BTD, call)


def close(got, want, rel=1e-5):
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=rel, atol=rel * np.abs(want).max())


@pytest.mark.parametrize("loss", ["sparse", "dense"])
def test_the_layer_and_its_indexer_loss_equal_the_reports_equations(loss):
    """Row 1's first key is padding; blocks of 4 x 4 on the chunked path (the indexer's
    scores and loss in blocks of 4 queries too). The early queries (fewer than topk allowed
    keys) keep all of theirs."""
    cfg = ModelConfig(**{**DSA, "mixer_settings": dict(SETTINGS, indexer_loss=loss)}, **CHUNKED)
    layer = make_layer(cfg)
    x_BTD = jax.random.normal(jax.random.key(0), (B, T, cfg.d_model))
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid_BS = jnp.arange(T)[None, :] >= jnp.array([[0], [1]])
    mask = MaskSpec.for_sequence(T, causal=True, k_valid=valid_BS)
    call = MixerCall(positions_BT=positions_BT, mask=mask, collect=("indexer_kl",))
    out_BTD, cache, kl = run_layer(layer, x_BTD, call)
    assert cache is None
    allowed_BTS = np.tril(np.ones((T, T), bool))[None] & np.asarray(valid_BS)[:, None, :]
    want_BTD, kept_BTS, logits_BNTS, scores_BTS = float64_dsa(
        x_BTD, layer_params(layer), allowed_BTS=allowed_BTS, positions_BT=positions_BT,
        settings=SETTINGS, theta=cfg.rope_theta, eps=cfg.norm_eps,
    )  # fmt: skip
    close(out_BTD, want_BTD)
    assert kept_BTS.sum(-1).max() == 3 and (kept_BTS != allowed_BTS).any()  # a selection
    dense_BTD = reference.latent_attention(
        x_BTD, layer_params(layer), mask=allowed_BTS, positions_BT=positions_BT,
        theta=cfg.rope_theta, eps=cfg.norm_eps,
    )[0]  # fmt: skip
    assert np.abs(dense_BTD - want_BTD).max() > 1e-2  # the selection moves the output
    support_BTS = kept_BTS if loss == "sparse" else allowed_BTS
    want_kl, want_rows = float64_kl(logits_BNTS, scores_BTS, support_BTS)
    assert want_kl > 1e-3
    np.testing.assert_allclose(float(kl["kl_sum"]), want_kl, rtol=1e-5)
    assert float(kl["rows"]) == want_rows == B * T - 1


@pytest.mark.slow(reason="compiles five cached calls of a layer; the fast tier checks the layer")
def test_a_prefill_split_anywhere_then_a_step_equals_one_pass():
    """Prefills of 3 + 4 and 4 + 3 tokens, then one decoding step (the absorbed form over
    the cached latents, the step's top-k over the cached indexer keys), equal the layer's
    pass over the whole sequence; the cache holds each token's indexer key."""
    cfg = ModelConfig(**DSA)
    layer = make_layer(cfg)
    S, n = 8, T + 1
    x_BTD = jax.random.normal(jax.random.key(1), (B, n, cfg.d_model))
    positions_BT = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))
    full_call = MixerCall(positions_BT=positions_BT, mask=MaskSpec.for_sequence(n, causal=True))
    want_BTD = run_layer(layer, x_BTD, full_call)[0]

    def run(cache, start, stop):
        m = stop - start
        start_B = jnp.full((B,), start, jnp.int32)
        view = LayerCache(cache.layers, jnp.int32(0), start_B, jnp.full((B,), m, jnp.int32),
                          None, cache.slot_axes)  # fmt: skip
        call = MixerCall(positions_BT=positions_BT[:, start:stop],
                         mask=MaskSpec.for_cache(m, S, start_B), cache=view)  # fmt: skip
        out_BTD, view, _ = run_layer(layer, x_BTD[:, start:stop], call)
        return out_BTD, cache.replace(layers=view.layers, lengths=start_B + m)

    for split in (3, 4):
        cache = init_cache(cfg, B, S)
        first_BTD, cache = run(cache, 0, split)
        rest_BTD, cache = run(cache, split, T)
        step_B1D, cache = run(cache, T, n)
        got_BTD = jnp.concatenate([first_BTD, rest_BTD, step_B1D], axis=1)
        close(got_BTD, want_BTD)
    assert cache.layers["index_keys"].shape == (cfg.n_layers, B, S, 6)
    assert np.abs(np.asarray(cache.layers["index_keys"][0, :, :n])).min() > 0  # written


@pytest.mark.slow(reason="compiles a model's prefill, decode steps and forward pass")
def test_cached_decoding_of_ragged_prompts_equals_the_forward_pass():
    mixer_checks.prefill_then_steps(ModelConfig(**DSA), atol=2e-5)


@pytest.mark.slow(reason="compiles a model's backward pass")
def test_gradients_are_finite_with_fully_masked_rows():
    mixer_checks.grads_finite_with_masked_rows(ModelConfig(**DSA))


@pytest.mark.slow(reason="compiles two backward passes of a layer")
def test_the_indexer_loss_trains_the_indexer_alone():
    """The output's gradient reaches no indexer parameter (the top-k is not
    differentiable), the indexer loss's gradient only those and not the layer's input
    (both scored in blocks of 4 queries, recomputed backwards)."""
    cfg = ModelConfig(**DSA, **CHUNKED)
    layer = make_layer(cfg)
    x_BTD = jax.random.normal(jax.random.key(2), (B, T, cfg.d_model))
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    call = MixerCall(positions_BT=positions_BT, mask=MaskSpec.for_sequence(T, causal=True),
                     collect=("indexer_kl",))  # fmt: skip
    graphdef, params = nnx.split(layer)

    def parts(params, x_BTD):
        (out_BTD, _, _), kl = sown_call(nnx.merge(graphdef, params), x_BTD, call)
        return jnp.sum(out_BTD**2), kl["kl_sum"]

    g_out = jax.jit(jax.grad(lambda p: parts(p, x_BTD)[0]))(params)
    g_kl, g_kl_x = jax.jit(jax.grad(lambda p, x: parts(p, x)[1], argnums=(0, 1)))(params, x_BTD)
    assert np.abs(np.asarray(g_kl_x)).max() == 0  # the indexer's input is detached
    for path, g in nnx.to_flat_state(g_out):
        index = str(path[0]).startswith("index_")
        assert (np.abs(np.asarray(g.get_value())).max() == 0) == index, path
    for path, g in nnx.to_flat_state(g_kl):
        index = str(path[0]).startswith("index_")
        assert (np.abs(np.asarray(g.get_value())).max() > 0) == index, path


def test_the_cache_adds_the_indexer_keys_to_mlas_entries():
    cfg = ModelConfig(**DSA)
    entries = get_mixer("dsa").cache_entries(cfg, cfg.mixer_settings)
    assert {n: e.shape for n, e in entries.items()} == {
        "latent": (-1, 12), "rope_keys": (-1, 4), "index_keys": (-1, 6),
    }  # fmt: skip
    per_token = (12 + 4 + 6) * 4 * cfg.n_layers
    assert attnlab.kv_cache_bytes(cfg, 1, 16, "float32") == 16 * per_token


def test_its_indexer_loss_is_a_step_metric_with_the_settings_weight():
    from attnlab import metrics

    cfg = ModelConfig(**{**DSA, "mixer_settings": dict(SETTINGS, indexer_loss_weight=0.5)})
    assert "dsa_indexer" in metrics.selected_names({}, cfg)
    assert metrics.get_metric("dsa_indexer").default_weight(cfg) == 0.5
    assert metrics.get_metric("dsa_indexer").needs == ("indexer_kl",)
    with pytest.raises(ConfigError, match="needs a sparse-attention layer"):
        metrics.get_metric("dsa_indexer").check(ModelConfig(**mixer_checks.TINY))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"topk": 0}, ["mixer_settings.topk=0", "positive int"]),
        ({"index_heads": 1.5}, ["mixer_settings.index_heads", "positive int"]),
        ({"index_head_dim": 2}, ["mixer_settings.index_head_dim", "qk_rope_head_dim=4"]),
        ({"indexer_loss": "kl"}, ["mixer_settings.indexer_loss", "'sparse'"]),
        ({"indexer_loss_weight": -1.0}, ["mixer_settings.indexer_loss_weight", ">= 0"]),
        ({"index_norm_eps": 0.0}, ["mixer_settings.index_norm_eps", "positive"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, words):
    mixer_checks.one_line_config_error(
        words, **{**DSA, "mixer_settings": dict(SETTINGS, **changes)}
    )
    with pytest.raises(ConfigError, match=r"ModelConfig.causal=False.*set causal=True"):
        ModelConfig(**DSA, causal=False)
    with pytest.raises(ConfigError, match=r"ModelConfig.position='alibi'.*set position='rope'"):
        ModelConfig(**{**DSA, "position": "alibi"})


@pytest.mark.slow(reason="compiles a train step")
def test_a_train_step_reports_and_optimises_the_indexer_loss():
    """The step's ``dsa_indexer`` is the layers' KL per query of the step's parameters (the
    model's collected ``indexer_kl``), and a step lowers it on the same batch (the weight
    joins the objective; the indexer's learning rate is the run's)."""
    import pathlib

    from attnlab import experiment
    from attnlab.train import Trainer

    root = pathlib.Path(__file__).resolve().parents[1]
    path = f"{root / 'experiments' / 'char_lm.py'}:tiny"
    cfg = experiment.load_config(path, ["--config.model.mixer=dsa"])
    cfg.model.mixer_settings.update(SETTINGS)
    model = {k: v for k, v in DSA.items() if k not in ("mixer", "mixer_settings")}
    cfg.model.update(dict(model, vocab_size=16, max_len=8, dropout=0.0, attention_dropout=0.0))
    cfg.data.seq_len, cfg.train.batch_size = 8, 2
    cfg.train.loss_weights = {"dsa_indexer": 10.0}
    cfg.optim.update(warmup_steps=0, learning_rate=3e-2, schedule="constant")
    trainer = Trainer(cfg, kind="lm")
    rng = np.random.default_rng(0)
    batch = {
        "inputs": rng.integers(0, 16, (2, 8), dtype=np.int32),
        "targets": rng.integers(0, 16, (2, 8), dtype=np.int32),
        "loss_mask": np.ones((2, 8), np.float32),
    }

    def kl_of(params):
        stats = trainer.model(params)(jnp.asarray(batch["inputs"]), collect=("indexer_kl",)).stats
        return float(jnp.sum(stats["indexer_kl"]["kl_sum"]) / jnp.max(stats["indexer_kl"]["rows"]))

    state = trainer.init_state()
    before = kl_of(state["params"])
    state, out = trainer.train_step(state, batch)
    np.testing.assert_allclose(float(out["metrics"]["dsa_indexer"]), before, rtol=1e-5)
    assert before > 1e-3 and kl_of(state["params"]) < before
