"""Families of 2025 built on attnlab's existing mixers: SmolLM3 (NoPE layers), OLMo 3
(sliding-window and full layers with a RoPE base each).

As in ``test_pretrained_open``: a tiny random checkpoint per family written by transformers at
test time (2 layers, d_model 32), every weight moved off its init. Logits equal transformers'
to 1e-4 at the real positions of a left-padded batch; the same tensors under a config.json
with the family's feature switched off move them by more than 1e-3; 16 greedy tokens through
attnlab's cache equal ``generate``; ``export_model`` writes a folder transformers reads with the
same logits. Parameter and cache sizes of the published configurations are computed from
their config.json numbers alone and checked against the model cards' totals.
"""

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers (and torch) are needed to write reference checkpoints"
)
torch = pytest.importorskip("torch", reason="transformers needs torch to build the models")

from test_export_hf import export_round_trips  # noqa: E402
from test_pretrained import max_diff  # noqa: E402
from test_pretrained_hf import hf, perturb  # noqa: E402
from test_pretrained_open import greedy_matches_transformers, left_padded  # noqa: E402
from tiers import cases  # noqa: E402

from attnlab import count_params  # noqa: E402
from attnlab.kv_cache import kv_cache_bytes  # noqa: E402
from attnlab.pretrained import (  # noqa: E402
    convert,
    load_pretrained,
    model_config_from_hf,
    read_tensors,
)

TOL = 1e-4
V = 96
_BASE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.125,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class, model class, kwargs, config.json changes that drop the feature)
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
        {"no_rope_layers": [1, 1]},
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
        {"layer_types": ["full_attention", "full_attention"]},
    ),
}
NAMES = list(SPECS)
SLOW = "one more family's checkpoint built by transformers and compiled (2-6 s)"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, folder), built lazily once per module."""
    built = {}

    def get(name):
        if name not in built:
            config_cls, model_cls, kwargs, _ = SPECS[name]
            config = getattr(transformers, config_cls)(**kwargs)
            seed = 31 + NAMES.index(name)
            torch.manual_seed(seed)
            model = getattr(transformers, model_cls)._from_config(
                config, attn_implementation="eager", dtype=torch.float32
            )
            perturb(model, torch.Generator().manual_seed(100 + seed))
            model.eval()
            model.generation_config.eos_token_id = None
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            built[name] = model, folder
        return built[name]

    return get


@pytest.mark.parametrize("name", cases(NAMES, slow={"olmo3": SLOW}))
def test_logits_match_transformers_and_the_feature_matters(checkpoints, name):
    model, folder = checkpoints(name)
    ids, mask = left_padded(np.random.default_rng(0))
    with torch.no_grad():
        expected = model(hf(ids), attention_mask=hf(mask)).logits.numpy()
    handle = load_pretrained(folder)
    assert handle.family == name
    real = mask.astype(bool)
    assert max_diff(np.asarray(handle.logits(ids, mask))[real], expected[real]) <= TOL
    # The same tensors under a config.json without the feature compute something else.
    off = {**handle.hf_config, **SPECS[name][3]}
    other = convert(off, read_tensors(folder), model_config_from_hf(off))
    assert max_diff(other(ids, valid_BT=real).logits[real], expected[real]) > 1e-3


@pytest.mark.slow(reason="16 cached greedy tokens compiled, against transformers' generate")
@pytest.mark.parametrize("name", NAMES)
def test_greedy_with_cache_matches_transformers(checkpoints, name):
    model, folder = checkpoints(name)
    greedy_matches_transformers(model, folder)


@pytest.mark.slow(reason="exports the loaded checkpoint and reads it back with transformers")
@pytest.mark.parametrize("name", NAMES)
def test_export_round_trips(checkpoints, tmp_path, name):
    model, folder = checkpoints(name)
    export_round_trips(model, folder, tmp_path / "out")


# Published configurations (config.json numbers as released) and their model cards' totals.
PUBLISHED = {
    # HuggingFaceTB/SmolLM3-3B: 3.08B parameters (tied embeddings); every layer full
    # attention, every fourth without RoPE.
    "smollm3": (
        dict(
            model_type="smollm3",
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=65536,
            rope_theta=5000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            no_rope_layer_interval=4,
        ),
        3.08e9,
    ),
    # allenai/Olmo-3-1025-7B: 7.30B parameters; three sliding layers (4096) then one full.
    "olmo3": (
        dict(
            model_type="olmo3",
            vocab_size=100278,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=65536,
            sliding_window=4096,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        7.30e9,
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_sizes_from_the_config_alone(name):
    c, card = PUBLISHED[name]
    cfg = model_config_from_hf(c)
    D, L, F, Vc = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    N, K = c["num_attention_heads"], c["num_key_value_heads"]
    H = D // N
    # Embedding (and an untied head), q k v o, SwiGLU, two norms per layer (OLMo: QK-norm
    # over the whole projections too), the final norm.
    per_layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F + 2 * D
    if name == "olmo3":
        per_layer += N * H + K * H
    total = Vc * D * (1 if c["tie_word_embeddings"] else 2) + L * per_layer + D
    assert count_params(cfg) == total
    assert abs(total - card) < 0.005e9  # the card's rounding
    # Keys and values of every layer in bfloat16 (3 in 4 OLMo 3 layers slide, but the
    # cache is linear while any layer attends to everything).
    assert kv_cache_bytes(cfg, 1, 1000) == 1000 * L * 2 * K * H * 2
    layers = cfg.layer_pattern
    if name == "smollm3":
        assert [spec.rope for spec in layers] == [(i + 1) % 4 != 0 for i in range(L)]
    else:
        assert [spec.window for spec in layers] == [
            None if (i + 1) % 4 == 0 else 4096 for i in range(L)
        ]
