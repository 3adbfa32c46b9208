"""The catalogue's families against transformers: SmolLM3 (NoPE layers), OLMo 3 (sliding and
full layers with a RoPE base each), Apertus (xIELU), GLM-4.5 (partial RoPE, q/k/v biases,
QK-norm, grouped sigmoid routing after a dense first layer), LFM2 (gated short convolutions
beside attention), Mamba (Mamba-1's selective scan), Jamba (Mamba-1 with inner norms,
attention without positions, experts every other layer) and Granite 4 (Mamba-2 and
attention, experts beside a shared SwiGLU, muP multipliers), Qwen3.5 (dense and
MoE: Qwen3-Next's hybrid with separately stored Gated DeltaNet projections), MiniMax
(lightning and softmax attention layers, experts in every layer, scaled normed residuals),
DeepSeek-V3.2 (DeepSeek-V3 with MLA over each query's top-k keys by a lightning indexer)
and Kimi Linear (Kimi Delta Attention and NoPE latent attention, grouped sigmoid routing
after a dense layer).

As in ``test_pretrained_open``: a tiny random checkpoint per family written by transformers at
test time (2 or 4 layers, d_model 32), every weight moved off its init. Logits equal transformers'
to 1e-4 at the real positions of a left-padded batch; the same tensors under a config.json
with each of the family's features switched off move them by more than 1e-3; 16 greedy tokens
through attnlab's cache equal ``generate``; ``export_model`` writes a folder transformers reads
with the same logits. Their published sizes: ``test_pretrained_catalogue_sizes``.
"""

import numpy as np
import pytest
from hf_reference import DECODER, V, built_once, hf_logits, tiny_model, torch, transformers
from test_export_hf import export_round_trips
from test_pretrained import max_diff
from test_pretrained_hf import perturb
from test_pretrained_open import greedy_matches_transformers, left_padded

from attnlab.pretrained import (
    convert,
    export_model,
    load_pretrained,
    model_config_from_hf,
    read_tensors,
)

TOL = 1e-4
_BASE = dict(DECODER, hidden_size=32, intermediate_size=64)

# name -> (config class, model class, kwargs, [config.json changes that drop one feature]);
# a change's "drop" lists stored names of tensors the plainer config has no place for, its
# "tensors" rewrites the stored tensors instead, its "model" the translated ModelConfig.
SPECS = {
    # A sliding layer with RoPE, then a full layer without (NoPE).
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            _BASE,
            no_rope_layers=[1, 0],
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        ),
        [{"no_rope_layers": [1, 1]}],
    ),
    # A sliding layer on a base of its own, then a full one.
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            _BASE,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            },
        ),
        [{"layer_types": ["full_attention", "full_attention"]}],
    ),
    # xIELU against the squared ReLU its positive branch generalises.
    "apertus": (
        "ApertusConfig",
        "ApertusForCausalLM",
        dict(_BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        [{"hidden_act": "relu2", "drop": ("act_fn.",)}],
    ),
    # 8 experts in 4 groups, 2 chosen from the best group; half of each head rotated.
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            _BASE,
            moe_intermediate_size=16,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=1,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
        [
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            {"n_group": 1, "topk_group": 1},
        ],
    ),
    # A convolution layer, then attention; the FFN width derived (two thirds of 72, to 16s).
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            _BASE,
            intermediate_size=72,
            block_multiple_of=16,
            initializer_range=0.3,  # at 0.125 its greedy tokens repeat one token
            layer_types=["conv", "full_attention"],
            tie_word_embeddings=False,
        ),
        [{"tensors": lambda t: {n: one_tap(x) if n.endswith("conv.conv.weight") else x
                                for n, x in t.items()}}],
    ),
    # Mamba-1 without FFNs; no memory across tokens when A's decay is made total.
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(
            vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
            conv_kernel=4, initializer_range=0.125, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False,
        ),
        [{"tensors": lambda t: {n: x + 30 if n.endswith("A_log") else x for n, x in t.items()}}],
    ),
    # Mamba, attention, Mamba, attention; experts in the attention layers (2 of 4 per token).
    # Off: the inner norms' learned scales set to one.
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            _BASE, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, mamba_d_state=4, use_mamba_kernels=False,
        ),
        [{"tensors": lambda t: {n: np.ones_like(x) if "layernorm" in n and ".mamba." in n
                                else x for n, x in t.items()}}],
    ),
    # Mamba-2 then attention with RoPE; 4 experts (2 per token) beside the shared SwiGLU;
    # every multiplier away from 1. Off: the residual multiplier back at 1.
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            _BASE, intermediate_size=16, shared_intermediate_size=24, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["mamba", "attention"], mamba_n_heads=4,
            mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4,
            position_embedding_type="rope", embedding_multiplier=3.0, logits_scaling=2.0,
            residual_multiplier=0.5, attention_multiplier=0.3,
        ),
        [{"residual_multiplier": 1.0}, {"attention_multiplier": 0.25}],
    ),
    # Gated DeltaNet (2 key heads, 2 value heads each) then gated attention; a quarter of
    # each head rotated by default. Off: the whole head rotated.
    "qwen3_5_text": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            _BASE, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
        ),
        [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 1.0}}],
    ),
    # As Qwen3.5, with 4 experts (2 per token) and the gated shared expert in every layer.
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            _BASE, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"],
        ),
        [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 1.0}}],
    ),
    # Lightning, lightning, softmax attention, lightning (blocks of 4 tokens); 4 experts (2 per
    # token) in every layer; each residual factor away from 1. Off: every layer softmax
    # attention on the lightning layers' q, k, v and output projections; the factors at 1;
    # no decay (a switch config.json lacks, made on the translated config).
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            _BASE, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
            block_size=4, layer_types=["linear_attention", "linear_attention",
                                       "full_attention", "linear_attention"],
            full_attn_alpha_factor=1.5, full_attn_beta_factor=0.7,
            linear_attn_alpha_factor=2.0, linear_attn_beta_factor=0.6,
            mlp_alpha_factor=1.3, mlp_beta_factor=0.8,
        ),
        [
            {"layer_types": ["full_attention"] * 4, "tensors": lambda t: lightning_as_softmax(t)},
            {"full_attn_alpha_factor": 1, "linear_attn_alpha_factor": 1, "mlp_alpha_factor": 1,
             "full_attn_beta_factor": 1, "linear_attn_beta_factor": 1, "mlp_beta_factor": 1},
            {"model": lambda cfg: without_decay(cfg)},
        ],
    ),
    # DeepSeek-V3 (MLA, a dense first layer, then grouped sigmoid routing) whose indexer keeps
    # 4 keys per query of the 20. Off: a top-k of every key (dense MLA). 16 indexer heads: a
    # key scores exactly 0 when every head's ReLU is 0; with 4 heads a checkpoint of another
    # seed had such ties at the top-k boundary, which torch and XLA break differently.
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            _BASE, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            moe_intermediate_size=24, routed_scaling_factor=2.5, index_topk=4, index_n_heads=16,
            index_head_dim=16,
        ),
        [{"index_topk": 64}],
    ),
    # Kimi Delta Attention in two layers, then NoPE latent attention; a dense first layer,
    # then 8 experts in 2 groups (2 chosen from the best group) beside a shared expert. Off:
    # the routed scale at 1; the latent attention a layer earlier (its tensors moved with it).
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            _BASE, num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=16,
            kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            linear_num_heads=2, linear_head_dim=8,
            layer_types=["linear_attention"] * 2 + ["full_attention"],
        ),
        [{"routed_scaling_factor": 1.0},
         {"layer_types": ["linear_attention", "full_attention", "linear_attention"],
          "tensors": lambda t: {swap_layers(n, ".self_attn.", 1, 2): x for n, x in t.items()}}],
    ),
}  # fmt: skip


def lightning_as_softmax(tensors, heads=4, kv_heads=2, head_dim=8):
    """MiniMax's lightning layers' ``qkv_proj`` (per head q, k, v) and ``out_proj`` as
    softmax attention's q/k/v/o projections (each key-value head from its group's first
    head); their gate, norm and decay buffers dropped."""
    out = {}
    for name, x in tensors.items():
        at, _, rest = name.rpartition("self_attn.")
        if rest == "qkv_proj.weight":
            q, k, v = np.split(x.reshape(heads, 3, head_dim, -1), 3, axis=1)
            first = slice(None, None, heads // kv_heads)
            out[at + "self_attn.q_proj.weight"] = q.reshape(heads * head_dim, -1)
            out[at + "self_attn.k_proj.weight"] = k[first].reshape(kv_heads * head_dim, -1)
            out[at + "self_attn.v_proj.weight"] = v[first].reshape(kv_heads * head_dim, -1)
        elif rest == "out_proj.weight":
            out[at + "self_attn.o_proj.weight"] = x
        elif not rest.startswith(("output_gate", "norm", "slope", "query", "key", "diagonal")):
            out[name] = x
    return out


def without_decay(cfg):
    """``cfg`` with its lightning layers' decay switched off."""
    kinds = lambda ks: [
        {**k, "mixer_settings": {**k["mixer_settings"], "decay": False}}
        if isinstance(k, dict) and k.get("mixer") == "lightning" else k
        for k in ks
    ]  # fmt: skip
    pattern = cfg.to_dict()["block_pattern"]
    return cfg.replace(
        block_pattern={"prefix": kinds(pattern["prefix"]), "block": kinds(pattern["block"])}
    )


def swap_layers(name, part, a, b):
    """``name`` with layers ``a`` and ``b`` exchanged when it holds ``part``."""
    for x, y in ((a, b), (b, a)):
        if f".layers.{x}.{part[1:]}" in name:
            return name.replace(f".layers.{x}.", f".layers.{y}.")
    return name


def one_tap(w):
    """A depthwise filter [Z, 1, W] reduced to its current-token tap, 1: no convolution."""
    out = np.zeros_like(w)
    out[..., -1] = 1
    return out


NAMES = list(SPECS)
SLOW = "a family's checkpoint built by transformers, loaded twice and compiled (2-6 s)"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, folder), built lazily once per module."""

    def build(name):
        config_cls, model_cls, kwargs, _ = SPECS[name]
        config = getattr(transformers, config_cls)(**kwargs)
        seed = 31 + NAMES.index(name)
        return tiny_model(
            model_cls, config, seed, (_perturb, 100 + seed), attn_implementation="eager"
        )

    return built_once(tmp_path_factory, build)


def _perturb(model, gen):
    """``perturb``, then the selection bias and xIELU's scalars off their init."""
    perturb(model, gen)
    with torch.no_grad():
        for n, p in [*model.named_parameters(), *model.named_buffers()]:
            if n.endswith(("e_score_correction_bias", "alpha_p", "alpha_n")):
                p.add_(0.5 * torch.randn(p.shape, generator=gen))


@pytest.mark.slow(reason=SLOW)
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_and_the_feature_matters(checkpoints, name):
    model, folder = checkpoints(name)
    ids, mask = left_padded(np.random.default_rng(0))
    expected = hf_logits(model, ids, mask)
    handle = load_pretrained(folder)
    assert handle.family == name
    real = mask.astype(bool)
    assert max_diff(np.asarray(handle.logits(ids, mask))[real], expected[real]) <= TOL
    # The same tensors under a config.json without a feature compute something else.
    for change in SPECS[name][3]:
        drop, rewrite = change.get("drop", ()), change.get("tensors", lambda t: t)
        off = {
            **handle.hf_config,
            **{k: v for k, v in change.items() if k not in ("drop", "tensors", "model")},
        }
        kept = {n: x for n, x in read_tensors(folder).items() if not any(d in n for d in drop)}
        kept = rewrite(kept)
        other = convert(off, kept, change.get("model", lambda c: c)(model_config_from_hf(off)))
        assert max_diff(other(ids, valid_BT=real).logits[real], expected[real]) > 1e-3, change


# Qwen3.5-MoE decodes with Qwen3.5's mixers and Qwen3-Next's experts, both decoded here and
# in test_pretrained_qwen3_next.
GREEDY = [n for n in NAMES if n != "qwen3_5_moe_text"]


@pytest.mark.slow(reason="16 cached greedy tokens compiled, against transformers' generate")
@pytest.mark.parametrize("name", GREEDY)
def test_greedy_with_cache_matches_transformers(checkpoints, name):
    model, folder = checkpoints(name)
    greedy_matches_transformers(model, folder)


@pytest.mark.slow(reason="exports the loaded checkpoint and reads it back with transformers")
@pytest.mark.parametrize("name", NAMES)
def test_export_round_trips(checkpoints, tmp_path, name):
    model, folder = checkpoints(name)
    if name not in EXPORTED_AS:
        export_round_trips(model, folder, tmp_path / "out")
        return
    # The same architecture as a family registered before it: written as that one.
    assert export_model(load_pretrained(folder).model, tmp_path / "out") == EXPORTED_AS[name]
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", dtype=torch.float32
    )
    ids, mask = left_padded(np.random.default_rng(3))
    real = mask.astype(bool)
    expected = hf_logits(model, ids, mask)[real]
    got = hf_logits(exported.eval(), ids, mask)[real]
    assert max_diff(got, expected) <= TOL


# Qwen3.5-MoE computes as Qwen3-Next (only its stored projections differ).
EXPORTED_AS = {"qwen3_5_moe_text": "qwen3_next"}
