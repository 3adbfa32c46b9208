"""Mixture-of-experts checkpoints that transformers writes: Mixtral, Qwen3-MoE, gpt-oss,
DeepSeek-V3.

As in ``test_pretrained_open``: a tiny random model per family, saved with
``save_pretrained`` (experts stored one tensor per expert, stacked by the loader; Mixtral in
shards listed by ``model.safetensors.index.json``), loaded by attnlab; logits ≤ 1e-4 at the
real positions of a left-padded batch, and 16 greedy tokens through attnlab's KV cache
equal to ``model.generate``. Four experts, two per token, so
the routing decides the outputs; Qwen3-MoE without renormalised top-k weights
(``norm_topk_prob=False``), Mixtral with; gpt-oss with a clamp low enough to bind, sinks,
a window shorter than the batch and YaRN over a short original context. Mixtral- and
Qwen3-MoE-shaped attnlab models are also exported and read back by transformers.
"""

import numpy as np
import pytest
from hf_reference import DECODER, built_once, hf_logits, tiny_model, torch, transformers
from test_export_hf import _LLAMA, perturbed, transformers_logits
from test_pretrained import max_diff
from test_pretrained_hf import perturb
from test_pretrained_open import greedy_matches_transformers, left_padded
from tiers import cases

from attnlab.config import ModelConfig
from attnlab.pretrained import convert, export_model, load_pretrained, read_tensors

TOL = 1e-4
_BASE = dict(DECODER, hidden_size=32, intermediate_size=48, initializer_range=0.25)
SPECS = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_BASE, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _BASE,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=False,
        ),
    ),
    # Sinks, biases everywhere, sliding then full attention, YaRN (truncate False) from a
    # 16-token context, experts with a clamped SwiGLU whose limit binds.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _BASE,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 500.0,
                "factor": 4.0,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # MLA with q compression; 8 experts in 4 groups (2 used), a shared expert, one dense
    # first layer, sigmoid scores with a selection bias, RoPE dims stored interleaved.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _BASE,
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            moe_intermediate_size=24,
            routed_scaling_factor=2.5,
        ),
    ),
}


@torch.no_grad()
def perturb_buffers(model, gen):
    """The selection bias is a buffer, zero at init: give it values that change choices;
    gpt-oss's sink logits go to the scale of the attention logits."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    for name, p in model.named_parameters():
        if name.endswith("self_attn.sinks"):
            p.copy_(1.0 + torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):

    def build(name):
        config_cls, model_cls, kwargs = SPECS[name]
        config = getattr(transformers, config_cls)(**kwargs)
        seed = 31 + list(SPECS).index(name)
        perturbs = (perturb, 100 + seed), (perturb_buffers, 200 + seed)
        return tiny_model(model_cls, config, seed, *perturbs, attn_implementation="eager")

    # Mixtral is written in shards (model.safetensors.index.json), as large ones are.
    shards = lambda name: {"max_shard_size": "100KB"} if name == "mixtral" else {}
    return built_once(tmp_path_factory, build, shards)


MOE_SLOW = "a mixture-of-experts checkpoint built and its routed forward compiled (~9 s)"
# The fast tier checks gpt-oss, the family with the most features of its own.
FAST = "gpt_oss"


@pytest.mark.parametrize("name", cases(list(SPECS), slow={n: MOE_SLOW for n in SPECS if n != FAST}))
def test_logits_match_transformers_with_left_padding(checkpoints, name):
    model, folder = checkpoints(name)
    ids, mask = left_padded(np.random.default_rng(0))
    expected = hf_logits(model, ids, mask)
    if name == "mixtral":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    handle = load_pretrained(folder)
    assert handle.family == name and handle.config.ffn_variant == "moe"
    real = mask.astype(bool)
    assert max_diff(np.asarray(handle.logits(ids, mask))[real], expected[real]) <= TOL
    if name == "gpt_oss":  # the clamp and YaRN bind: loading without either moves the logits
        ffn = handle.config.ffn_settings.to_dict()
        tensors = read_tensors(folder)
        for change in ({"ffn_settings": {**ffn, "swiglu_limit": None}}, {"rope_scaling": None}):
            other = convert(handle.hf_config, tensors, handle.config.replace(**change))
            assert max_diff(other(ids, valid_BT=real).logits[real], expected[real]) > 1e-3


@pytest.mark.slow(reason="cached decoding of a mixture-of-experts model, compiled")
@pytest.mark.parametrize(
    "name",
    [
        "mixtral",
        "qwen3_moe",
        "gpt_oss",
        "deepseek_v3",
    ],
)
def test_greedy_with_cache_matches_transformers(checkpoints, name):
    model, folder = checkpoints(name)
    greedy_matches_transformers(model, folder)


_MOE_MODEL = dict(_LLAMA, d_model=32, d_ff=48, ffn_variant="moe")  # Llama-shaped, experts
EXPORTS = {
    "mixtral": dict(_MOE_MODEL, ffn_settings={"n_experts": 4, "top_k": 2}),
    # QK-norm, experts narrower than d_ff, top-k weights not renormalised.
    "qwen3_moe": dict(
        _MOE_MODEL,
        head_dim=16,
        qk_norm=True,
        ffn_settings={"n_experts": 4, "top_k": 2, "d_expert": 24, "renormalize": False},
    ),
    # Sinks and biases, sliding then full layers, YaRN, the clamped SwiGLU with biases.
    "gpt_oss": dict(
        _MOE_MODEL,
        head_dim=8,
        mixer="sinks",
        attn_bias=True,
        out_bias=True,
        layer_pattern=[{"window": 5}, {"window": None}],
        rope_scaling={"kind": "yarn", "factor": 4.0, "original_max_len": 16, "truncate": False},
        ffn_settings={
            "n_experts": 4, "top_k": 2, "d_expert": 24, "router_bias": True,
            "expert_bias": True, "swiglu_limit": 1.0, "load_balance_weight": 0.001,
        },
    ),
    # MLA with q compression, a dense first layer, grouped sigmoid routing with a selection
    # bias, a shared expert, YaRN with DeepSeek's mscale.
    "deepseek_v3": dict(
        _MOE_MODEL,
        n_layers=3,
        n_kv_heads=4,
        head_dim=12,
        mixer="mla",
        mixer_settings={"kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8,
                        "qk_rope_head_dim": 4, "v_head_dim": 12},
        rope_scaling={"kind": "yarn", "factor": 4.0, "original_max_len": 16, "mscale": 0.707},
        ffn_settings={
            "n_experts": 8, "top_k": 2, "d_expert": 24, "score": "sigmoid", "n_group": 4,
            "topk_group": 2, "selection_bias": True, "routed_scaling": 2.5, "n_shared": 1,
            "dense_layers": 1,
        },
    ),
}  # fmt: skip


@pytest.mark.slow(reason="a mixture-of-experts model exported and read by transformers")
@pytest.mark.parametrize("family", list(EXPORTS))
def test_moe_shaped_model_exports_with_equal_logits(tmp_path, family):
    model = perturbed(ModelConfig(**EXPORTS[family]), seed=4)
    assert export_model(model, tmp_path / "hf") == family
    ids, mask = left_padded(np.random.default_rng(5))
    real = mask.astype(bool)
    ours = np.asarray(model(ids, valid_BT=real).logits)
    assert max_diff(ours[real], transformers_logits(tmp_path / "hf", ids, mask)[real]) <= TOL


def test_gpt_oss_config_without_layer_types_or_rope_takes_transformers_defaults():
    """A config.json that leaves out ``layer_types`` and the RoPE settings is read with
    transformers' defaults: sliding layers first, YaRN 32x from 4,096 tokens, base 150,000."""
    from attnlab.pretrained.configs import model_config_from_hf

    kwargs = dict(SPECS["gpt_oss"][2], num_hidden_layers=3, max_position_embeddings=131072)
    del kwargs["rope_parameters"]
    theirs = transformers.GptOssConfig(**kwargs)
    ours = model_config_from_hf(dict(kwargs, model_type="gpt_oss"))
    windows = [5 if t == "sliding_attention" else None for t in theirs.layer_types]
    assert list(ours.layer_windows(3)) == windows == [5, None, 5]
    rope = theirs.rope_parameters
    assert ours.rope_theta == rope["rope_theta"] == 150000.0
    s = ours.rope_scaling
    assert (s.kind, s.factor, s.original_max_len, s.truncate) == (
        rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"],
        rope["truncate"],
    )  # fmt: skip
