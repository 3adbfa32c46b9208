"""The mixture-of-experts FFN: routing, the auxiliary losses, dropless dispatch, the model.

References: ``tests/moe_reference.py`` (float64 NumPy from the formulas), transformers'
DeepSeek-V3 router (with the ``hf`` extra), hand-computed losses and parameter counts.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from moe_reference import expert_layer_clamped_dense, expert_layer_dense
from moe_reference import route as np_route

import attnlab
from attnlab import ModelConfig, build_model, count_params, ops
from attnlab.errors import ConfigError
from attnlab.ops import moe
from attnlab.train.objectives import objective_sums


def test_top_k_and_renormalisation_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(32, 8)).astype(np.float32)
    bias = rng.normal(size=(8,)).astype(np.float32) * 0.3
    cases = [
        dict(score="softmax", renormalize=True),
        dict(score="softmax", renormalize=False),
        dict(score="sigmoid", renormalize=True, bias=bias, scaling=2.5),
        dict(score="sigmoid", renormalize=False, bias=bias),
    ]
    for case in cases:
        want_e, want_w = np_route(logits, 3, **case)
        kw = {k: v for k, v in case.items() if k != "bias"}
        sel = None if "bias" not in case else jnp.asarray(case["bias"])
        got_e, got_w, _ = moe.route(jnp.asarray(logits), top_k=3, selection_bias_E=sel, **kw)
        np.testing.assert_array_equal(np.asarray(got_e), want_e, err_msg=str(case))
        np.testing.assert_allclose(np.asarray(got_w), want_w, rtol=1e-6, err_msg=str(case))


@pytest.mark.slow(
    reason="builds transformers' DeepSeek-V3 router beside ours (~7 s); the top-k and "
    "renormalisation test keeps routing in the fast tier"
)
def test_grouped_routing_picks_the_experts_of_transformers_deepseek_v3():
    torch = pytest.importorskip("torch")
    mod = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    groups = dict(top_k=4, n_group=4, topk_group=2, scaling=2.5)  # said once for both
    hf_cfg = DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, norm_topk_prob=True,
        num_experts_per_tok=groups["top_k"], n_group=groups["n_group"],
        topk_group=groups["topk_group"], routed_scaling_factor=groups["scaling"],
    )  # fmt: skip
    router = mod.DeepseekV3TopkRouter(hf_cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.1)
        logits, weights, experts = router(torch.randn(64, 16, generator=gen))
    bias_E = jnp.asarray(router.e_score_correction_bias.numpy())
    got_e, got_w, _ = moe.route(
        jnp.asarray(logits.numpy()), score="sigmoid", selection_bias_E=bias_E, **groups
    )
    order = np.argsort(experts.numpy(), axis=-1)  # transformers leaves the k unsorted
    want_e = np.take_along_axis(experts.numpy(), order, -1)
    want_w = np.take_along_axis(weights.numpy(), order, -1)
    mine = np.argsort(np.asarray(got_e), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got_e), mine, -1), want_e)
    got_w = np.take_along_axis(np.asarray(got_w), mine, -1)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5)


def test_load_balancing_loss_is_the_switch_formula_on_a_hand_computed_case():
    # Router probabilities of 4 tokens over 2 experts; top-1 sends 3 tokens to expert 0.
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.4, 0.6]], np.float32)
    expert, _, scores = moe.route(jnp.log(probs), top_k=1)
    # f = (3/4, 1/4), P = (2.8/4, 1.2/4) = (0.7, 0.3): 2 * (0.75 * 0.7 + 0.25 * 0.3) = 1.2
    assert float(moe.load_balancing_loss(scores, expert)) == pytest.approx(1.2, rel=1e-6)
    uniform = jnp.full((6, 4), 0.25)
    spread = jnp.array([[0, 1], [2, 3], [0, 1], [2, 3], [0, 2], [1, 3]])
    assert float(moe.load_balancing_loss(uniform, spread)) == pytest.approx(1.0, rel=1e-6)


def test_router_z_loss_is_the_mean_squared_logsumexp():
    logits = np.random.default_rng(1).normal(size=(10, 4))
    want = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    got = float(moe.router_z_loss(jnp.asarray(logits, jnp.float32)))
    assert got == pytest.approx(want, rel=1e-5)


def _experts(seed, E=4, D=8, F=6, gated=True):
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.normal(size=s) * 0.5).astype(np.float32)
    return w(E, D, F), w(E, F, D), (w(E, D, F) if gated else None)


@pytest.mark.parametrize("kind", ["swiglu", "relu"])
def test_dropless_dispatch_equals_every_expert_on_every_token_then_mask(kind):
    gated = kind == "swiglu"
    w_in, w_out, w_gate = _experts(0, gated=gated)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(24, 8)).astype(np.float32)
    experts, weights = np_route(rng.normal(size=(24, 4)), 2)
    want = expert_layer_dense(x, experts, weights, w_in, w_out, w_gate)
    args = (jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights, jnp.float32))
    gate = None if w_gate is None else jnp.asarray(w_gate)
    got = moe.expert_ffn(*args, jnp.asarray(w_in), jnp.asarray(w_out), kind=kind, w_gate_EDF=gate)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # Split over two "devices" of two experts each, the parts sum to the whole.
    parts = [
        moe.expert_ffn(
            *args,
            jnp.asarray(w_in[i : i + 2]),
            jnp.asarray(w_out[i : i + 2]),
            kind=kind,
            w_gate_EDF=None if gate is None else gate[i : i + 2],
            expert_range=(jnp.int32(i), 4),
        )
        for i in (0, 2)
    ]
    np.testing.assert_allclose(np.asarray(parts[0] + parts[1]), want, atol=1e-5, rtol=1e-5)


def test_gpt_oss_experts_clamped_swiglu_with_biases_equal_the_dense_reference():
    """``glu=clamped_swiglu`` and the three biases against gpt-oss's formula in float64; the
    limit (0.5) binds, so the unclamped SwiGLU gives other outputs."""
    w_in, w_out, w_gate = _experts(4)
    rng = np.random.default_rng(5)
    b_in, b_gate, b_out = (rng.normal(size=s).astype(np.float32) for s in ((4, 6), (4, 6), (4, 8)))
    x = rng.normal(size=(24, 8)).astype(np.float32)
    experts, weights = np_route(rng.normal(size=(24, 4)), 2)
    want = expert_layer_clamped_dense(
        x, experts, weights, w_in, w_gate, w_out, b_in, b_gate, b_out, alpha=1.702, limit=0.5
    )
    run = lambda glu: moe.expert_ffn(
        jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights, jnp.float32),
        jnp.asarray(w_in), jnp.asarray(w_out), kind="swiglu", w_gate_EDF=jnp.asarray(w_gate),
        b_in_EF=jnp.asarray(b_in), b_gate_EF=jnp.asarray(b_gate), b_out_ED=jnp.asarray(b_out),
        glu=glu,
    )  # fmt: skip
    got = run(functools.partial(ops.clamped_swiglu, alpha=1.702, limit=0.5))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(run(None)) - want).max() > 1e-2


def test_no_assignment_is_dropped_when_every_token_picks_the_same_expert():
    w_in, w_out, w_gate = _experts(2)
    x = np.random.default_rng(3).normal(size=(16, 8)).astype(np.float32)
    experts = np.tile([[3, 1]], (16, 1))
    weights = np.full((16, 2), 0.5)
    want = expert_layer_dense(x, experts, weights, w_in, w_out, w_gate)
    got = moe.expert_ffn(
        jnp.asarray(x),
        jnp.asarray(experts),
        jnp.asarray(weights, jnp.float32),
        jnp.asarray(w_in),
        jnp.asarray(w_out),
        kind="swiglu",
        w_gate_EDF=jnp.asarray(w_gate),
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    assert moe.tokens_per_expert(jnp.asarray(experts), 4).tolist() == [0, 16, 0, 16]


@pytest.mark.parametrize(
    "settings,needle",
    [
        ({"top_k": 9}, r"ffn_settings\.top_k=9 is invalid: at most n_experts=8"),
        ({"n_group": 3}, r"ffn_settings\.n_group=3 is invalid: must divide n_experts=8"),
        ({"score": "relu"}, r"ffn_settings\.score='relu' is invalid: use one of"),
        ({"dense_layers": 2}, r"ffn_settings\.dense_layers=2 is invalid: fewer than n_layers"),
        ({"experts": 4}, r"unknown field\(s\) \['experts'\] for ffn_variant='moe'"),
        ({"swiglu_limit": 7.0}, r"ffn_settings\.swiglu_limit=7\.0 is invalid: clamps a SwiGLU"),
        ({"swiglu_limit": -1.0}, r"ffn_settings\.swiglu_limit=-1\.0 is invalid: a positive"),
    ],
)
def test_bad_settings_name_the_field_and_the_fix(settings, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig(n_layers=2, ffn_variant="moe", ffn_settings=settings)
    with pytest.raises(ConfigError, match=r"ffn_variant='nope' is not registered"):
        ModelConfig(ffn_variant="nope")


def small(**settings):
    base = dict(n_experts=4, top_k=2, d_expert=16, n_shared=1, dense_layers=1)
    return ModelConfig(
        vocab_size=32,
        d_model=16,
        n_layers=3,
        n_heads=2,
        max_len=16,
        position="rope",
        norm="rmsnorm",
        ffn="swiglu",
        d_ff=24,
        ffn_variant="moe",
        ffn_settings={**base, **settings},
    )


@pytest.mark.slow(
    reason="compiles a mixture-of-experts train objective three times (~6 s); the load-balancing "
    "and z-loss formula tests keep the auxiliary losses in the fast tier"
)
def test_the_auxiliary_losses_join_the_objective_with_their_weights():
    cfg = small(load_balance_weight=0.5, z_loss_weight=0.25)
    model = build_model(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 32)
    batch = {"inputs": tokens, "targets": tokens, "loss_mask": jnp.ones((2, 8))}
    s, n, _, aux = objective_sums(model, batch, "lm")
    assert aux["tokens_per_expert"].shape == (2, 4)  # the two MoE layers after the dense one
    assert aux["tokens_per_expert"].sum(-1).tolist() == [2 * 8 * 2] * 2
    assert aux["dropped"].tolist() == [0, 0]
    want = np.sum(0.5 * np.asarray(aux["load_balance"]) + 0.25 * np.asarray(aux["z_loss"]))
    assert float(aux["loss"]) == pytest.approx(float(want), rel=1e-6)
    # Without cross-entropy the router still learns from the auxiliary loss.
    graphdef, params = nnx.split(model)
    aux_only = lambda p: objective_sums(nnx.merge(graphdef, p), batch, "lm")[3]["loss"]
    g = jax.grad(aux_only)(params)
    assert float(jnp.abs(g["decoder"]["layers"]["ffn"]["router_DE"][...]).max()) > 0


def test_dense_prefix_scanned_and_unrolled_forward_agree():
    cfg = small()
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
    model = build_model(cfg, seed=0)
    graphdef, params = nnx.split(model)
    unrolled = nnx.graphdef(build_model(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0)))
    run = jax.jit(lambda g, p: nnx.merge(g, p)(tokens).logits, static_argnums=0)
    np.testing.assert_allclose(run(unrolled, params), run(graphdef, params), rtol=1e-5, atol=1e-6)


@pytest.mark.slow(reason="differentiates three programs of the stack (about 30 s on 2 cores)")
def test_dense_prefix_scanned_unrolled_and_rematerialised_agree():
    cfg = small()
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
    batch = {"inputs": tokens, "targets": tokens, "loss_mask": jnp.ones((2, 8))}
    params = nnx.state(build_model(cfg, seed=0))

    def loss_and_grads(c):
        graphdef = nnx.graphdef(build_model(c, rngs=nnx.Rngs(0)))
        f = lambda p: objective_sums(nnx.merge(graphdef, p), batch, "lm")
        return jax.value_and_grad(lambda p: f(p)[0] + f(p)[3]["loss"])(params)

    ref_loss, ref_g = loss_and_grads(cfg)
    assert "w_in_DF" in dict(params["decoder"]["prefix"]["ffn"])  # the plain FFN
    for other in (cfg.replace(scan_layers=False), cfg.replace(remat="full")):
        loss, g = loss_and_grads(other)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g, ref_g)


# The dense parts of Mixtral and DeepSeek-V3 (as of Llama): SwiGLU, RMSNorm, RoPE, untied.
LLAMA_STYLE = dict(ffn="swiglu", norm="rmsnorm", position="rope", tie_embeddings=False)


def test_total_and_active_parameters_of_mixtral_and_deepseek_v3():
    # Mixtral-8x7B's config.json: 32 layers, hidden 4096, 32 heads / 8 kv heads of 128,
    # intermediate 14336, 8 experts top-2, vocab 32000, untied embeddings.
    D, V, L, F, E = 4096, 32000, 32, 14336, 8
    mixtral = ModelConfig(
        vocab_size=V, d_model=D, n_layers=L, n_heads=32, n_kv_heads=8, d_ff=F, **LLAMA_STYLE,
        ffn_variant="moe", ffn_settings=dict(n_experts=E, top_k=2),
    )  # fmt: skip
    attn = 2 * D * 32 * 128 + 2 * D * 8 * 128
    expert = 3 * D * F
    total = L * (attn + E * expert + D * E + 2 * D) + 2 * V * D + D
    assert count_params(mixtral) == total == 46_702_792_704  # the card: 46.7B
    assert count_params(mixtral, active=True) == total - L * 6 * expert == 12_879_925_248

    # DeepSeek-V3's config.json (the main model; the card's 671B leaves out the MTP module).
    D, V, L, N, E, Fe = 7168, 129280, 61, 128, 256, 2048
    deepseek = ModelConfig(
        vocab_size=V, d_model=D, n_layers=L, n_heads=N, head_dim=128, d_ff=18432, **LLAMA_STYLE,
        mixer="mla",
        mixer_settings=dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128),
        ffn_variant="moe",
        ffn_settings=dict(n_experts=E, top_k=8, d_expert=Fe, score="sigmoid", selection_bias=True,
                          n_group=8, topk_group=4, n_shared=1, routed_scaling=2.5, dense_layers=3),
    )  # fmt: skip
    attn = D * 1536 + 1536 + 1536 * N * 192 + D * 576 + 512 + 512 * N * 256 + N * 128 * D
    routed = E * 3 * D * Fe
    moe_layer = D * E + E + routed + 3 * D * Fe
    total = L * (attn + 2 * D) + 3 * 3 * D * 18432 + (L - 3) * moe_layer + 2 * V * D + D
    assert count_params(deepseek) == total == 671_026_419_200  # the card: 671B
    active = total - (L - 3) * routed // E * (E - 8)
    assert count_params(deepseek, active=True) == active == 37_552_297_472  # the card: 37B


def test_gpt_oss_parameter_counts_from_its_config_match_the_model_card():
    """gpt-oss-120b's config.json through the loader's translator: 116.8B total; active
    5.71B with the embedding table, 5.13B without (the card's count: 117B / 5.1B)."""
    from attnlab.pretrained.configs import model_config_from_hf

    V, D, L, E, F, N, K, H = 201088, 2880, 36, 128, 2880, 64, 8, 64
    cfg = model_config_from_hf(
        dict(
            model_type="gpt_oss", vocab_size=V, hidden_size=D, intermediate_size=F,
            num_hidden_layers=L, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
            num_local_experts=E, num_experts_per_tok=4, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * (L // 2),
            attention_bias=True, tie_word_embeddings=False,
        )
    )  # fmt: skip
    attn = 2 * D * N * H + 2 * D * K * H + N * H + 2 * K * H + D + N  # q k v o, biases, sinks
    expert = 3 * D * F + 2 * F + D  # gate, up, down and their biases
    total = L * (attn + E * expert + D * E + E + 2 * D) + 2 * V * D + D
    assert count_params(cfg) == total == 116_829_156_672
    active = total - L * (E - 4) * expert
    assert count_params(cfg, active=True) == active == 5_711_982_912
    assert active - V * D == 5_132_849_472  # the card: 5.1B


def test_the_moe_variant_is_registered_beside_the_plain_ffn():
    assert {"dense", "moe"} <= set(attnlab.registered_ffns())
