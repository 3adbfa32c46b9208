"""The open families of today loaded from checkpoints transformers writes: Gemma, Gemma 2,
Gemma 3 (text), OLMo 2 and Phi-3.

As in ``test_pretrained_hf``: a tiny random model per family (nothing is downloaded), its
norms, biases and projections moved off their init, saved with ``save_pretrained`` and loaded
by attnlab. Logits must match transformers to 1e-4 at the real positions of a left-padded
batch, and 16 greedy tokens decoded through attnlab's KV cache must equal
``model.generate(do_sample=False)``, with the logits that chose them within 1e-4. Each tiny
config turns on what makes its family different (a window shorter than the sequence,
soft caps small enough to bind, a local RoPE base, partial rotary), and each family has a
check that the feature matters: loading without it gives other logits.
"""

import numpy as np
import pytest
from hf_reference import (
    DECODER,
    V,
    built_once,
    generate_greedy,
    hf_logits,
    tiny_model,
    torch,
    transformers,
)
from test_pretrained import max_diff
from test_pretrained_hf import hf, perturb
from tiers import cases

from attnlab.pretrained import convert, load_pretrained, read_tensors

TOL = 1e-4
_BASE = DECODER

# name -> (config class, model class, kwargs, {ModelConfig field: value that drops the feature})
SPECS = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_BASE, head_dim=24), {"embed_scale": False}),
    # Caps small enough to bind on a tiny random model; query_pre_attn_scalar != head_dim.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            _BASE,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=5,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
        ),
        {"logits_softcap": None},
    ),
    # Local, global, local: the local layers with a RoPE base of their own.
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _BASE,
            num_hidden_layers=3,
            head_dim=24,
            query_pre_attn_scalar=16,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            },
        ),
        {"layer_pattern": [{"window": 5}, {"window": None}, {"window": 5}]},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_BASE), {"norm_placement": "pre"}),
    # Half of each head rotates.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(_BASE, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
        {"rotary_dim": None},
    ),
}
NAMES = list(SPECS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, folder), built lazily once per module."""

    def build(name):
        config_cls, model_cls, kwargs, _ = SPECS[name]
        config = getattr(transformers, config_cls)(**kwargs)
        seed = 11 + NAMES.index(name)
        return tiny_model(
            model_cls, config, seed, (perturb, 100 + seed), attn_implementation="eager"
        )

    return built_once(tmp_path_factory, build)


def left_padded(rng):
    """Ids [2, 20]: row 1 left-padded, real from position 6 on."""
    ids = rng.integers(3, V, (2, 20)).astype(np.int32)
    mask = np.ones((2, 20), np.int32)
    mask[1, :6] = 0
    ids[1, :6] = 0
    return ids, mask


# The fast tier checks Gemma 2's logits and Gemma 3's cached decoding.
LOGITS_SLOW = "one more open family's checkpoint built and compiled"


@pytest.mark.parametrize(
    "name", cases(NAMES, slow={n: LOGITS_SLOW for n in NAMES if n != "gemma2"})
)
def test_logits_match_transformers_with_left_padding(checkpoints, name):
    model, folder = checkpoints(name)
    ids, mask = left_padded(np.random.default_rng(0))
    expected = hf_logits(model, ids, mask)
    handle = load_pretrained(folder)
    assert handle.family == name
    real = mask.astype(bool)
    logits = np.asarray(handle.logits(ids, mask))
    assert max_diff(logits[real], expected[real]) <= TOL
    # The family's own feature matters: without it the logits differ.
    without = handle.config.replace(**SPECS[name][3])
    other = convert(handle.hf_config, read_tensors(folder), without)
    assert max_diff(other(ids, valid_BT=real).logits[real], expected[real]) > 1e-3


GREEDY_SLOW = "one more open family's cached decoding, compiled, against transformers' generate"


def greedy_matches_transformers(model, folder, *, length=9, n=16, vocab=V):
    """``n`` greedy tokens of ``load_pretrained(folder)`` through its cache equal
    transformers' ``generate`` of ``model`` (without a cache) on a random prompt, and their
    logits agree to ``TOL``."""
    handle = load_pretrained(folder)
    prompt = np.random.default_rng(2).integers(3, vocab, (1, length)).astype(np.int32)
    out = generate_greedy(model, hf(prompt), n)
    expected = out.sequences.numpy()[:, length:]
    assert len(set(expected[0].tolist())) >= 2  # not one token repeated
    result = handle.generate(prompt, n, eos_id=None, return_logits=True)
    np.testing.assert_array_equal(np.asarray(result.tokens), expected)
    assert max_diff(result.logits, torch.stack(out.logits, 1).numpy()) <= TOL


@pytest.mark.parametrize(
    "name", cases(NAMES, slow={n: GREEDY_SLOW for n in NAMES if n != "gemma3_text"})
)
def test_greedy_with_cache_matches_transformers(checkpoints, name):
    model, folder = checkpoints(name)
    greedy_matches_transformers(model, folder)
