"""Checkpoints written by transformers itself: mistral, qwen2, qwen3, bart and t5.

Each test builds a tiny random model from a transformers Config (nothing is downloaded),
moves its norms, biases and relative-position tables away from their trivial init (so a
dropped weight or bias shows), saves it with ``save_pretrained`` and loads the folder with
attnlab. Logits must match to 1e-4 on a batch with a right-padded row, padded positions
included, and greedy generation must reproduce ``model.generate(do_sample=False)``.
"""

import importlib.util
import re

import numpy as np
import pytest
from hf_reference import (
    DECODER,
    V,
    built_once,
    generate_greedy,
    hf,  # read from here by the other checkpoint tests
    hf_logits,
    tiny_model,
    torch,
    transformers,
)
from test_pretrained import cached_greedy, max_diff
from tiers import cases

from attnlab.pretrained import convert, load_pretrained, read_tensors

TOL = 1e-4
HAS_DECODE = importlib.util.find_spec("attnlab.decode") is not None

_DECODER = dict(DECODER, rms_norm_eps=1e-6)
_SEQ2SEQ = dict(vocab_size=V, pad_token_id=1, eos_token_id=2, decoder_start_token_id=0)

SPECS = {
    # A window shorter than the sequences, so it changes the outputs.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_DECODER, sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_DECODER, tie_word_embeddings=True)),
    # head_dim 24 != hidden_size / heads = 16.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_DECODER, head_dim=24)),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        dict(
            _SEQ2SEQ,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
            init_std=0.125,
            scale_embedding=True,
            forced_eos_token_id=None,
        ),
    ),
    # T5 v1.1: gated-GELU, no output rescale; d_kv 24 != d_model / heads.
    "t5_v1_1": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            vocab_size=V,
            d_model=64,
            d_kv=24,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=3,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            decoder_start_token_id=0,
        ),
    ),
    # Original T5: ReLU FFN, tied head with the d_model**-0.5 rescale.
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            vocab_size=V,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            feed_forward_proj="relu",
            decoder_start_token_id=0,
        ),
    ),
}

# Perturbations of the init (name patterns, first match wins).
# The norm that feeds the output head (BART is post-norm: its last layer's last norm).
_HEAD_NORMS = (
    r"^(model\.norm|decoder\.final_layer_norm|model\.decoder\.layers\.1\.final_layer_norm)\.weight$"
)
_NORMS = r"(norm|LayerNorm|layernorm)[^.]*\.weight$"
_QK = r"\.(q_proj|k_proj|q|k)\.weight$"
_OUT = r"\.(o_proj|out_proj|o|down_proj|fc2|wo)\.weight$"


@torch.no_grad()
def perturb(model, gen):
    def normal(p):
        return torch.randn(p.shape, generator=gen)

    for name, p in model.named_parameters():
        if re.search(_HEAD_NORMS, name):
            p.copy_(normal(p))  # random signs: the head cannot just echo its input
        elif re.search(_NORMS, name):
            p.copy_(1 + 0.2 * normal(p))
        elif name.endswith("relative_attention_bias.weight"):
            p.copy_(0.5 * normal(p))
        elif name.endswith("bias"):
            p.copy_(0.1 * normal(p))
        elif re.search(_QK, name):
            p.mul_(2.0)
        elif re.search(_OUT, name):
            p.mul_(0.5)
    if hasattr(model, "final_logits_bias"):
        model.final_logits_bias.copy_(0.1 * normal(model.final_logits_bias))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, folder), built lazily once per module."""

    def build(name):
        config_cls, model_cls, kwargs = SPECS[name]
        config = getattr(transformers, config_cls)(**kwargs)
        seed = 1 + list(SPECS).index(name)
        model = tiny_model(
            model_cls, config, seed, (perturb, 100 + seed), attn_implementation="eager"
        )
        model.generation_config.forced_bos_token_id = None
        model.generation_config.forced_eos_token_id = None
        return model

    return built_once(tmp_path_factory, build)


def batch(name, rng):
    """Right-padded ids with the config's pad id: row 1 is real for 13 of 20 positions."""
    pad = SPECS[name][2].get("pad_token_id", 0)
    ids = rng.integers(3, V, (2, 20)).astype(np.int32)
    mask = np.ones((2, 20), np.int32)
    mask[1, 13:] = 0
    ids[1, 13:] = pad
    return ids, mask


def hf_ids(x):
    return np.asarray(x, np.int32)


def attended_rows(mask, window):
    """[B, T] True where a query has at least one real key in its (windowed) causal range.

    With a window, a padded query far enough past the real tokens sees padding only;
    attnlab gives such fully masked rows zero attention output, transformers a uniform
    average over every key (finfo.min everywhere), so those rows are not compared.
    """
    B, T = mask.shape
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed_TT = (k <= q) & (k > q - (window or T))
    return (allowed_TT[None] & mask.astype(bool)[:, None, :]).any(-1)


DECODERS = ["mistral", "qwen2", "qwen3"]
SEQ2SEQ = ["bart", "t5_v1_1", "t5"]


@pytest.mark.parametrize(
    "name", cases(DECODERS, slow=dict(mistral="a third decoder family, the slowest to build"))
)
def test_decoder_logits_match_transformers(checkpoints, name):
    model, folder = checkpoints(name)
    ids, mask = batch(name, np.random.default_rng(0))
    expected = hf_logits(model, ids, mask)
    handle = load_pretrained(folder)
    assert handle.family == name
    logits = np.asarray(handle.logits(ids, mask))
    attends = attended_rows(mask, handle.config.sliding_window)
    assert max_diff(logits[attends], expected[attends]) <= TOL
    assert max_diff(logits[mask.astype(bool)], expected[mask.astype(bool)]) <= TOL
    if name == "mistral":  # the window matters: without it the outputs differ
        cfg = handle.config.replace(sliding_window=None)
        full = convert(handle.hf_config, read_tensors(folder), cfg)
        assert max_diff(full(hf_ids(ids), valid_BT=mask.astype(bool)).logits, expected) > 1e-2


@pytest.mark.parametrize(
    "name", cases(SEQ2SEQ, slow=dict(t5_v1_1="a second T5 checkpoint format, the slowest to build"))
)
def test_seq2seq_logits_match_transformers(checkpoints, name):
    model, folder = checkpoints(name)
    rng = np.random.default_rng(1)
    ids, mask = batch(name, rng)
    start = SPECS[name][2]["decoder_start_token_id"]
    tgt = rng.integers(3, V, (2, 10)).astype(np.int32)
    tgt[:, 0] = start
    with torch.no_grad():
        expected = model(hf(ids), attention_mask=hf(mask), decoder_input_ids=hf(tgt)).logits
    handle = load_pretrained(folder)
    logits = handle.logits(ids, mask, decoder_input_ids=tgt)
    assert max_diff(logits, expected.numpy()) <= TOL


# The fast tier decodes one decoder (qwen2) and one encoder-decoder (bart) against transformers.
GREEDY_SLOW = "one more family's cached decoding, compiled, against transformers' generate"


@pytest.mark.parametrize(
    "name",
    cases(
        DECODERS + SEQ2SEQ,
        slow={n: GREEDY_SLOW for n in ("mistral", "qwen3", "t5_v1_1", "t5", "bart")},
    ),
)
def test_greedy_matches_transformers_generate(checkpoints, name):
    model, folder = checkpoints(name)
    handle = load_pretrained(folder)
    seq2seq = handle.config.arch == "encoder_decoder"
    n, length = 10, 9
    prompt = np.random.default_rng(2).integers(3, V, (1, length)).astype(np.int32)
    # No HF cache: its cache assumes as many decoder layers as encoder layers (t5_v1_1).
    out = generate_greedy(model, hf(prompt), n)
    expected = out.sequences.numpy()[:, 1 if seq2seq else length :]
    expected_logits = torch.stack(out.logits, 1).numpy()
    assert expected.shape == (1, n)
    assert len(set(expected[0].tolist())) >= 3  # not one token repeated
    if HAS_DECODE:  # the library's KV-cache decoder
        result = handle.generate(prompt, n, eos_id=None, return_logits=True)
        ids, step_logits = result.tokens, result.logits
    else:  # the tests' own one-token-at-a-time loop over the model's cache
        ids, step_logits = cached_greedy(handle, prompt, n)
    np.testing.assert_array_equal(np.asarray(ids), expected)
    assert max_diff(step_logits, expected_logits) <= TOL
