"""Parameter and cache arithmetic of the catalogue's families from config.json alone:
``count_params`` (total and active) and ``kv_cache_bytes`` of each published configuration
(its config.json numbers written here, nothing downloaded) against a count by hand and the
model card's total."""

import math

import pytest
from tiers import cases

from attnlab import count_params
from attnlab.kv_cache import kv_cache_bytes
from attnlab.pretrained import model_config_from_hf

# Published configurations (config.json numbers as released) and their model cards' totals.
PUBLISHED = {
    # HuggingFaceTB/SmolLM3-3B: 3.08B parameters (tied embeddings); every layer full
    # attention, every fourth without RoPE.
    "smollm3": dict(
        model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008,
        num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=65536, rope_theta=5000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False, no_rope_layer_interval=4,
    ),
    # allenai/Olmo-3-1025-7B: 7.30B parameters; three sliding layers (4096) then one full.
    "olmo3": dict(
        model_type="olmo3", vocab_size=100278, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=65536, sliding_window=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # swiss-ai/Apertus-8B-2509: 8.05B parameters; xIELU FFN, QK-norm, Llama 3 RoPE scaling.
    "apertus": dict(
        model_type="apertus", vocab_size=131072, hidden_size=4096, intermediate_size=21504,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=65536, hidden_act="xielu", rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    # zai-org/GLM-4.5: 355B parameters, 32B active (the card's active count leaves out the
    # embeddings; its total counts the multi-token-prediction layer, which attnlab does not
    # load: 3.9B of a MoE layer and its projections).
    "glm4_moe": dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=5120, intermediate_size=12288,
        moe_intermediate_size=1536, num_hidden_layers=92, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, n_routed_experts=160, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
        max_position_embeddings=131072, tie_word_embeddings=False, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "partial_rotary_factor": 0.5},
    ),
    # LiquidAI/LFM2-1.2B: 1.17B parameters (tied embeddings); 10 convolution layers, attention
    # at 2, 5, 8, 10, 12 and 14; the FFN 8192 wide (two thirds of 12288).
    "lfm2": dict(
        model_type="lfm2", vocab_size=65536, hidden_size=2048, intermediate_size=12288,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=128000, norm_eps=1e-5, conv_L_cache=3, conv_bias=False,
        block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
        full_attn_idxs=[2, 5, 8, 10, 12, 14], tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # state-spaces/mamba-130m-hf: 129M parameters (tied embeddings), no attention.
    "mamba": dict(
        model_type="mamba", vocab_size=50280, hidden_size=768, state_size=16,
        num_hidden_layers=24, expand=2, conv_kernel=4, time_step_rank=48, use_bias=False,
        use_conv_bias=True, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
    ),
    # ai21labs/Jamba-v0.1: 52B parameters, 12B active; attention in 4 of 32 layers, experts
    # (2 of 16 per token) in every other layer.
    "jamba": dict(
        model_type="jamba", vocab_size=65536, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_experts=16,
        num_experts_per_tok=2, attn_layer_period=8, attn_layer_offset=4,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=256, mamba_conv_bias=True, mamba_proj_bias=False,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    # MiniMaxAI/MiniMax-Text-01-hf: 456B parameters, 45.9B activated per token (the card's
    # active count leaves out the embeddings); softmax attention in every eighth of 80
    # layers, lightning attention in the others; experts (2 of 32 per token) in every layer.
    "minimax": dict(
        model_type="minimax", vocab_size=200064, hidden_size=6144, intermediate_size=9216,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        num_local_experts=32, num_experts_per_tok=2, block_size=256,
        layer_types=["full_attention" if (i + 1) % 8 == 0 else "linear_attention"
                     for i in range(80)],
        full_attn_alpha_factor=3.5565588200778455, full_attn_beta_factor=1.0,
        linear_attn_alpha_factor=3.5565588200778455, linear_attn_beta_factor=1.0,
        mlp_alpha_factor=3.5565588200778455, mlp_beta_factor=1.0,
        max_position_embeddings=10240000, rms_norm_eps=1e-5, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
        router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False,
    ),
    # deepseek-ai/DeepSeek-V3.2-Exp: 671B parameters, 37B activated (the card: DeepSeek-V3.1's
    # architecture with the lightning indexer added; its 685B on disk count the MTP layer,
    # which attnlab does not load). MLA over the indexer's top 2048 keys in every layer.
    "deepseek_v32": dict(
        model_type="deepseek_v32", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc",
        n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
        norm_topk_prob=True, scoring_func="sigmoid", max_position_embeddings=163840,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000,
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096},
        index_topk=2048, index_head_dim=128, index_n_heads=64,
    ),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct: 48B parameters, 3B activated; Kimi Delta
    # Attention in 20 layers, NoPE latent attention in 7 (1-based 4, 8, ..., 24 and 27);
    # a dense first layer, then 8 of 256 experts and a shared one. transformers' model of this
    # config on the meta device holds 49,122,681,728 parameters and selection biases, as
    # counted here by hand.
    "kimi_linear": dict(
        model_type="kimi_linear", vocab_size=163840, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32, head_dim=72,
        hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        model_max_length=1048576, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, first_k_dense_replace=1,
        moe_intermediate_size=1024, moe_layer_freq=1, moe_renormalize=True,
        moe_router_activation_func="sigmoid", num_experts=256, num_experts_per_token=8,
        num_shared_experts=1, routed_scaling_factor=2.446, use_grouped_topk=True,
        num_expert_group=1, topk_group=1, num_nextn_predict_layers=0,
        linear_attn_config={
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23,
                           25, 26],
            "num_heads": 32, "short_conv_kernel_size": 4,
        },
    ),
}  # fmt: skip


def deepseek_v32_counts(c) -> tuple[int, int, int]:
    """DeepSeek-V3.2 by hand: MLA (q_a, its norm, q_b; kv_a with the rope key, its norm,
    kv_b; o), the indexer (wq_b, wk, the key's LayerNorm, weights_proj), 3 dense SwiGLU
    FFNs, then 256 experts (8 per token), one shared expert and the router with its bias."""
    D, L, V_ = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    N, R, Rq = c["num_attention_heads"], c["kv_lora_rank"], c["q_lora_rank"]
    Hn, Hr, Hv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    J, Hi = c["index_n_heads"], c["index_head_dim"]
    mla = D * Rq + Rq + Rq * N * (Hn + Hr) + D * (R + Hr) + R + R * N * (Hn + Hv) + N * Hv * D
    indexer = Rq * J * Hi + D * Hi + 2 * Hi + D * J
    E, k, Fe = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    dense = c["first_k_dense_replace"]
    moe = E * D + E + 3 * D * Fe * c["n_shared_experts"] + E * 3 * D * Fe
    embed = 2 * V_ * D
    total = embed + L * (mla + indexer + 2 * D) + dense * 3 * D * c["intermediate_size"]
    total += (L - dense) * moe + D
    return total, total - (L - dense) * (E - k) * 3 * D * Fe, embed


def kimi_linear_counts(c) -> tuple[int, int, int]:
    """Kimi Linear by hand: KDA (q, k, v and their convolutions, the forget gate's two
    projections, A_log, dt_bias, beta, the output gate's two projections, its norm, o), MLA
    (q, the latent and shared key, its norm, the up-projection, o), the dense FFN, experts."""
    D, V_, F = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    lin = c["linear_attn_config"]
    N, H = lin["num_heads"], lin["head_dim"]
    kda = 3 * D * N * H + 3 * 4 * N * H + (D * H + H * N * H) + N + N * H + D * N
    kda += (D * H + H * N * H) + H + N * H * D
    keys = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    (Na, Hn, Hr, Hv), R = (c[k] for k in keys), c["kv_lora_rank"]
    mla = D * Na * (Hn + Hr) + D * (R + Hr) + R + R * Na * (Hn + Hv) + Na * Hv * D
    E, k, Fe = c["num_experts"], c["num_experts_per_token"], c["moe_intermediate_size"]
    shared = 3 * D * Fe * c["num_shared_experts"]
    moe = E * D + E + shared + E * 3 * D * Fe  # router, selection bias, shared, experts
    moe_active = E * D + E + shared + k * 3 * D * Fe
    n_kda, n_mla = len(lin["kda_layers"]), len(lin["full_attn_layers"])
    L = n_kda + n_mla
    embed = 2 * V_ * D
    total = embed + n_kda * kda + n_mla * mla + 3 * D * F + (L - 1) * moe + L * 2 * D + D
    return total, total - (L - 1) * (moe - moe_active), embed


def mamba_layer(D, J, R, conv=4, inner_norms=False) -> int:
    """One Mamba-1 mixer: in_proj, conv and its bias, x_proj, dt_proj and its bias, A, D,
    out_proj (and Jamba's norms on dt, B, C)."""
    Z = 2 * D
    return (
        D * 2 * Z
        + conv * Z
        + Z
        + Z * (R + 2 * J)
        + R * Z
        + Z
        + Z * J
        + Z
        + Z * D
        + (R + 2 * J if inner_norms else 0)
    )


def published_counts(name, c) -> tuple[int, int, int]:
    """``(parameters, active parameters, embedding parameters)`` of config.json ``c``, by
    hand: embeddings and head, attention (q, k, v, o; biases, QK-norm), FFNs, norms."""
    if name == "kimi_linear":
        return kimi_linear_counts(c)
    if name == "mamba":
        D, L, Vm = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        total = Vm * D + L * (mamba_layer(D, c["state_size"], c["time_step_rank"]) + D) + D
        return total, total, Vm * D
    if name == "deepseek_v32":
        return deepseek_v32_counts(c)
    if name == "jamba":  # 28 Mamba and 4 attention layers; 16 SwiGLU and 16 expert FFNs
        D, L, F, Vj = (
            c["hidden_size"],
            c["num_hidden_layers"],
            c["intermediate_size"],
            c["vocab_size"],
        )
        N, K, E, k = c["num_attention_heads"], c["num_key_value_heads"], c["num_experts"], 2
        H = D // N
        attention = D * (N + 2 * K) * H + N * H * D
        mamba = mamba_layer(D, c["mamba_d_state"], c["mamba_dt_rank"], inner_norms=True)
        ffn = 3 * D * F
        embed = 2 * Vj * D
        total = (
            embed + 4 * attention + 28 * mamba + 16 * ffn + 16 * (E * ffn + E * D) + L * 2 * D + D
        )
        active = total - 16 * (E - k) * ffn
        return total, active, embed
    D, L, F, V_ = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    N, K = c["num_attention_heads"], c["num_key_value_heads"]
    H = c.get("head_dim") or D // N
    embed = V_ * D * (1 if c["tie_word_embeddings"] else 2)
    attention = D * (N + 2 * K) * H + N * H * D
    attention += {
        "olmo3": N * H + K * H,
        "apertus": 2 * H,
        "glm4_moe": (N + 2 * K) * H + 2 * H,
    }.get(name, 0)
    norms = 2 * D
    if name == "glm4_moe":
        E, k = c["n_routed_experts"], c["num_experts_per_tok"]
        Fe, dense = c["moe_intermediate_size"], c["first_k_dense_replace"]
        shared = 3 * D * Fe * c["n_shared_experts"]
        router = E * D + E  # and the selection bias
        moe = router + shared + E * 3 * D * Fe
        moe_active = router + shared + k * 3 * D * Fe
        total = embed + L * (attention + norms) + dense * 3 * D * F + (L - dense) * moe + D
        active = total - (L - dense) * (moe - moe_active)
        return total, active, embed
    if name == "minimax":  # 70 lightning and 10 attention layers; experts in every layer
        E, k = c["num_local_experts"], c["num_experts_per_tok"]
        n_attention = c["layer_types"].count("full_attention")
        lightning = 3 * D * N * H + D * N * H + N * H + N * H * D  # qkv, gate, norm, out
        mixers = n_attention * attention + (L - n_attention) * lightning
        moe = E * D + E * 3 * D * F  # the router and the experts
        total = embed + mixers + L * (moe + norms) + D
        return total, total - L * (E - k) * 3 * D * F, embed
    if name == "lfm2":  # attention (QK-norm) or the convolution; the FFN 8192 wide
        n_attention = len(c["full_attn_idxs"])
        conv = 3 * D * D + 3 * D + D * D  # in_proj (b, c, h), 3 taps, out_proj
        mixers = n_attention * (attention + 2 * H) + (L - n_attention) * conv
        total = embed + mixers + L * (3 * D * 8192 + norms) + D
        return total, total, embed
    ffn = 2 * D * F + 2 if name == "apertus" else 3 * D * F  # xIELU: up, down, two scalars
    total = embed + L * (attention + ffn + norms) + D
    return total, total, embed


CARDS = {"smollm3": (3.08e9, None), "olmo3": (7.30e9, None), "apertus": (8.05e9, None),
         "glm4_moe": (355e9, 32e9), "lfm2": (1.17e9, None), "mamba": (0.129e9, None),
         "jamba": (52e9, 12e9), "minimax": (456e9, 45.9e9),
         "deepseek_v32": (671e9, 37e9), "kimi_linear": (48e9, 3e9)}  # fmt: skip


HYBRID_SIZES = "traces a hybrid stack's parameter shapes (about 2 s)"
# Its last layer breaks the 3:1 repeat, so the stack unrolls 21 of its 27 layers.
KIMI_SIZES = "traces Kimi Linear's parameter shapes, 21 layers unrolled (5 to 10 s)"


@pytest.mark.parametrize(
    "name",
    cases(
        list(PUBLISHED),
        slow={
            "lfm2": HYBRID_SIZES,
            "jamba": HYBRID_SIZES,
            "minimax": HYBRID_SIZES,
            "kimi_linear": KIMI_SIZES,
        },
    ),
)
def test_published_sizes_from_the_config_alone(name):
    c = PUBLISHED[name]
    cfg = model_config_from_hf(c)
    total, active, embed = published_counts(name, c)
    # A block without FFN keeps an FFN norm it never reads (ffn_variant="none"): D per layer.
    unread = c["num_hidden_layers"] * c["hidden_size"] if name == "mamba" else 0
    assert count_params(cfg) == total + unread
    assert count_params(cfg, active=True) == active + unread
    card_total, card_active = CARDS[name]
    if card_active is None:
        assert abs(total - card_total) < 0.005 * 10 ** math.floor(math.log10(card_total))
    elif name == "jamba":  # the card's whole billions
        assert abs(total - card_total) < 0.5e9 and abs(active - card_active) < 0.5e9
    elif name == "minimax":  # the card's 456B and 45.9B (without the embeddings)
        assert abs(total - card_total) < 0.5e9 and abs(active - embed - card_active) < 0.05e9
    elif name == "deepseek_v32":  # V3's 671B and 37B, the indexer's 0.85B on top
        assert 0 < total - card_total < 1e9 and abs(active - card_active) < 1.5e9
        # Per token and layer: the latent (512), the rope key (64) and the indexer's key
        # (128), in bfloat16: 704 * 2 bytes * 61 layers.
        assert kv_cache_bytes(cfg, 1, 1000) == 1000 * 61 * (512 + 64 + 128) * 2 == 85_888_000
        assert cfg.mixer == "dsa" and cfg.mixer_settings.topk == 2048
        return
    elif (
        name == "kimi_linear"
    ):  # the card rounds: 49.1B total, 3.5B active (2.7B without embeddings)
        assert abs(total - card_total) < 1.5e9 and abs(active - card_active) < 0.6e9
    else:  # GLM-4.5: the MTP layer (about 3.9B) is the difference to the card's total
        assert 2e9 < card_total - total < 4.5e9
        assert abs(active - embed - card_active) < 0.5e9
    # Keys and values of every layer in bfloat16 (3 in 4 OLMo 3 layers slide, but the
    # cache is linear while any layer attends to everything).
    if name == "mamba":  # a fixed-size state and conv state per sequence, float32
        per_layer = 2 * 768 * 16 + 3 * 2 * 768
        assert kv_cache_bytes(cfg, 1, 1000) == kv_cache_bytes(cfg, 1, 10) == 24 * per_layer * 4
        return
    if name == "kimi_linear":  # 7 latents and shared keys (bfloat16), 20 KDA states (float32)
        kda_state = 32 * 128 * 128 + 3 * 3 * 32 * 128  # the state and 3 conv inputs of q, k, v
        assert kv_cache_bytes(cfg, 1, 1000) == 1000 * 7 * (512 + 64) * 2 + 20 * kda_state * 4
        return
    if name == "jamba":  # keys and values of 4 layers (bfloat16), 28 Mamba states (float32)
        mamba_state = 2 * 4096 * 16 + 3 * 2 * 4096
        assert kv_cache_bytes(cfg, 1, 1000) == 1000 * 4 * 2 * 8 * 128 * 2 + 28 * mamba_state * 4
        return
    if name == "minimax":  # keys and values of 10 layers (bfloat16), 70 lightning states
        state = 64 * 128 * 128  # [N, H, H] per layer, float32
        assert kv_cache_bytes(cfg, 1, 1000) == 1000 * 10 * 2 * 8 * 128 * 2 + 70 * state * 4
        return
    L, K = c["num_hidden_layers"], c["num_key_value_heads"]
    H = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if name == "lfm2":  # keys and values of 6 layers; 10 layers' conv state (2 inputs, float32)
        assert kv_cache_bytes(cfg, 1, 1000) == 1000 * 6 * 2 * K * H * 2 + 10 * 2 * 2048 * 4
    else:
        assert kv_cache_bytes(cfg, 1, 1000) == 1000 * L * 2 * K * H * 2
    if name == "smollm3":
        assert [spec.rope for spec in cfg.layer_pattern] == [(i + 1) % 4 != 0 for i in range(L)]
    if name == "olmo3":
        windows = [spec.window for spec in cfg.layer_pattern]
        assert windows == [None if (i + 1) % 4 == 0 else 4096 for i in range(L)]
