"""Checkpoints whose RoPE is scaled, loaded by attnlab and compared with transformers: Llamas
with linear and with Llama 3.1's ``llama3`` scaling, a Gemma 3 whose global layer is scaled
linearly while its local layers keep their own base unscaled, a Phi-3 with LongRoPE (partial rotary,
a 16-token original context: the 20-token batch uses the long factors, its first 12 tokens
alone the short ones), and a DeepSeek-V3 with YaRN and DeepSeek's mscale pair (a factor on the
rotated dims and a temperature on the whole logit). gpt-oss's YaRN is in
``test_pretrained_moe``.

As in ``test_pretrained_open``: logits ≤ 1e-4 at the real positions of a left-padded batch,
and loading without the scaling moves them by more than 1e-3; 16 greedy tokens through the
KV cache equal transformers'. LongRoPE's greedy prompt is already past the original context:
transformers recomputes the whole sequence when generation crosses it, while attnlab's
cache keeps the keys as they were rotated (docs/pretrained.md). Llama-, Gemma 3- and
Phi-3-shaped models with these scalings are exported and read back by transformers.
"""

import numpy as np
import pytest
from hf_reference import built_once, hf_logits, tiny_model, torch, transformers
from test_pretrained import max_diff
from test_pretrained_hf import hf, perturb
from test_pretrained_moe import SPECS as MOE_SPECS
from test_pretrained_moe import perturb_buffers
from test_pretrained_open import _BASE, greedy_matches_transformers, left_padded
from test_pretrained_open import SPECS as OPEN_SPECS

from attnlab.pretrained import convert, load_pretrained, read_tensors

TOL = 1e-4
V = _BASE["vocab_size"]
_DS = MOE_SPECS["deepseek_v3"][2]
_GEMMA3 = OPEN_SPECS["gemma3_text"][2]
# name -> (family, config class, model class, kwargs)
SPECS = {
    "linear": (
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(_BASE, rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0}),
    ),
    "llama3": (
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            _BASE,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "longrope": (
        "phi3",
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            _BASE,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "factor": 4.0, "short_factor": [1.0, 1.5, 2.5, 4.0],
                "long_factor": [2.0, 4.0, 8.0, 16.0],
            },
        ),
    ),
    # Linear scaling on the global layer only; the local layers keep their own base unscaled.
    "gemma3_linear": (
        "gemma3_text",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _GEMMA3,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            },
        ),
    ),
    "yarn": (
        "deepseek_v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _DS,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                "mscale_all_dim": 1.0, "beta_fast": 8, "beta_slow": 1,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):

    def build(name):
        _, config_cls, model_cls, kwargs = SPECS[name]
        config = getattr(transformers, config_cls)(**kwargs)
        seed = 51 + list(SPECS).index(name)
        perturbs = (perturb, 100 + seed), (perturb_buffers, 200 + seed)
        return tiny_model(model_cls, config, seed, *perturbs, attn_implementation="eager")

    return built_once(tmp_path_factory, build)


@pytest.mark.slow(reason="a scaled-RoPE checkpoint built and compiled, then again unscaled")
@pytest.mark.parametrize("name", list(SPECS))
def test_logits_match_transformers_with_left_padding(checkpoints, name):
    model, folder = checkpoints(name)
    ids, mask = left_padded(np.random.default_rng(0))
    expected = hf_logits(model, ids, mask)
    handle = load_pretrained(folder)
    assert handle.family == SPECS[name][0]
    params = SPECS[name][3]["rope_parameters"]
    kind = params.get("full_attention", params)["rope_type"]
    assert handle.config.rope_scaling.kind == kind
    real = mask.astype(bool)
    assert max_diff(np.asarray(handle.logits(ids, mask))[real], expected[real]) <= TOL
    if name == "longrope":  # within the original context: the short factors
        with torch.no_grad():
            short = model(hf(ids[:1, :12])).logits.numpy()
        assert max_diff(handle.logits(ids[:1, :12]), short) <= TOL
    unscaled = handle.config.replace(rope_scaling=None)
    other = convert(handle.hf_config, read_tensors(folder), unscaled)
    assert max_diff(other(ids, valid_BT=real).logits[real], expected[real]) > 1e-3


@pytest.mark.slow(reason="cached decoding of a scaled-RoPE model, compiled, against generate")
@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_with_cache_matches_transformers(checkpoints, name):
    model, folder = checkpoints(name)
    greedy_matches_transformers(model, folder, length=18 if name == "longrope" else 9, vocab=V)


EXPORTS = {
    "gemma3_text": dict(
        head_dim=24, norm_placement="sandwich", ffn="geglu_tanh", embed_scale=True,
        qk_norm=True, attn_scale=16**-0.5, n_layers=3, rope_theta=10000.0,
        layer_pattern=[{"window": 5, "rope_theta": 10.0}, {"window": None},
                       {"window": 5, "rope_theta": 10.0}],
        rope_scaling={"kind": "linear", "factor": 8.0},
    ),
    "llama": dict(
        rope_scaling={"kind": "llama3", "factor": 8.0, "original_max_len": 16,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    ),
    # Rows of 20 tokens against a 16-token original context: the long factors.
    "phi3": dict(
        rotary_dim=8,
        rope_scaling={"kind": "longrope", "factor": 4.0, "original_max_len": 16,
                      "short_factor": [1.0, 1.5, 2.5, 4.0], "long_factor": [2.0, 4.0, 8.0, 16.0]},
    ),
}  # fmt: skip


@pytest.mark.slow(reason="a scaled-RoPE model exported and read by transformers")
@pytest.mark.parametrize("family", list(EXPORTS))
def test_scaled_model_exports_with_equal_logits(tmp_path, family):
    from test_export_hf import _LLAMA, perturbed, transformers_logits

    from attnlab.config import ModelConfig
    from attnlab.pretrained import export_model

    model = perturbed(ModelConfig(**{**_LLAMA, **EXPORTS[family]}), seed=6)
    assert export_model(model, tmp_path / "hf") == family
    ids, mask = left_padded(np.random.default_rng(5))
    real = mask.astype(bool)
    ours = np.asarray(model(ids, valid_BT=real).logits)
    assert max_diff(ours[real], transformers_logits(tmp_path / "hf", ids, mask)[real]) <= TOL
