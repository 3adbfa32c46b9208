"""Parameter and cache arithmetic of the hybrid families with experts, from config.json alone:
Qwen3.5-35B-A3B (Gated DeltaNet 3:1 with gated attention, 256 experts) and
Granite-4.0-H-Tiny (Mamba-2 9:1 with attention, 64 experts beside a shared FFN).

``count_params`` is checked against transformers' own model of the same config, built on
the meta device (its parameters' sizes, nothing allocated), the active count against the
experts left out by hand, and ``kv_cache_bytes`` against the cache written out by hand:
keys and values of the attention layers (bfloat16), the fixed recurrent and conv states of
the others (float32)."""

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers (and torch) count the reference parameters"
)
torch = pytest.importorskip("torch", reason="transformers needs torch to build the models")

from attnlab import count_params  # noqa: E402
from attnlab.kv_cache import kv_cache_bytes  # noqa: E402
from attnlab.pretrained import model_config_from_hf  # noqa: E402

# ibm-granite/granite-4.0-h-tiny's config.json (the fields the model reads); its card: 7B
# parameters, 1B active.
GRANITE_4_H_TINY = dict(
    model_type="granitemoehybrid", vocab_size=100352, hidden_size=1536, num_hidden_layers=40,
    num_attention_heads=12, num_key_value_heads=4, intermediate_size=512,
    shared_intermediate_size=1024, num_local_experts=64, num_experts_per_tok=6,
    tie_word_embeddings=True, mamba_d_state=128, mamba_n_groups=1, mamba_n_heads=48,
    mamba_d_head=64, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=256,
    max_position_embeddings=131072, position_embedding_type="nope",
    layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9
    + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4,
)  # fmt: skip


def qwen3_5_35b_a3b() -> dict:
    """Qwen/Qwen3.5-35B-A3B's text model: transformers' default ``Qwen3_5MoeTextConfig`` is
    that checkpoint's (its card: 35B parameters with the vision encoder, 3B active)."""
    return transformers.Qwen3_5MoeTextConfig().to_dict()


def transformers_count(model_class, config_class, c) -> int:
    with torch.device("meta"):
        model = model_class(config_class(**{k: v for k, v in c.items() if k != "model_type"}))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow(reason="builds a 35B-parameter transformers model on the meta device (1 s)")
def test_qwen3_5_moe_sizes_from_the_config_alone():
    c = qwen3_5_35b_a3b()
    cfg = model_config_from_hf(c)
    want = transformers_count(
        transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig, c
    )
    D, L, E, k, F = (c[n] for n in ("hidden_size", "num_hidden_layers", "num_experts",
                                     "num_experts_per_tok", "moe_intermediate_size"))  # fmt: skip
    assert count_params(cfg) == want
    assert count_params(cfg, active=True) == want - L * (E - k) * 3 * D * F
    assert abs(want - 35e9) < 1e9  # the card's 35B includes the vision encoder
    assert abs(count_params(cfg, active=True) - 3e9) < 0.5e9

    attention = c["layer_types"].count("full_attention")
    linear = L - attention
    K, H = c["num_key_value_heads"], c["head_dim"]
    Nv, Dk, Dv = (c[n] for n in ("linear_num_value_heads", "linear_key_head_dim",
                                  "linear_value_head_dim"))  # fmt: skip
    channels = 2 * c["linear_num_key_heads"] * Dk + Nv * Dv  # q, k, v through the conv
    state = Nv * Dk * Dv + channels * (c["linear_conv_kernel_dim"] - 1)
    assert (attention, linear) == (10, 30)
    for T in (10, 1000):
        assert kv_cache_bytes(cfg, 1, T) == T * attention * 2 * K * H * 2 + linear * state * 4


@pytest.mark.slow(reason="builds a 7B-parameter transformers model on the meta device (2 s)")
def test_granite_4_sizes_from_the_config_alone():
    c = GRANITE_4_H_TINY
    cfg = model_config_from_hf(c)
    want = transformers_count(
        transformers.GraniteMoeHybridForCausalLM, transformers.GraniteMoeHybridConfig, c
    )
    D, L, E, k, F = (c[n] for n in ("hidden_size", "num_hidden_layers", "num_local_experts",
                                     "num_experts_per_tok", "intermediate_size"))  # fmt: skip
    assert count_params(cfg) == want
    assert count_params(cfg, active=True) == want - L * (E - k) * 3 * D * F
    assert abs(want - 7e9) < 0.5e9 and abs(count_params(cfg, active=True) - 1e9) < 0.5e9

    attention = c["layer_types"].count("attention")
    mamba = L - attention
    inner = c["mamba_expand"] * D
    channels = inner + 2 * c["mamba_n_groups"] * c["mamba_d_state"]  # x, B, C through the conv
    state = c["mamba_n_heads"] * c["mamba_d_head"] * c["mamba_d_state"]
    state += channels * (c["mamba_d_conv"] - 1)
    K, H = c["num_key_value_heads"], D // c["num_attention_heads"]
    assert (attention, mamba) == (4, 36)
    for T in (10, 1000):
        assert kv_cache_bytes(cfg, 1, T) == T * attention * 2 * K * H * 2 + mamba * state * 4
