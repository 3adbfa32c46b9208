"""Mamba-2 hybrid checkpoints that transformers writes: Bamba (``BambaForCausalLM``),
Falcon-H1 (``FalconH1ForCausalLM``) and Nemotron-H (``NemotronHForCausalLM``).

A tiny random model is saved with ``save_pretrained`` (its norms, projections, decays, skips
and conv taps moved off their init) and loaded by attnlab: logits ≤ 1e-4 at the real
positions of a left-padded batch against transformers' float32 forward, and 16 greedy tokens
through attnlab's cache equal to ``model.generate``.

Bamba is a hybrid stack of ``mamba2`` and ``mha`` layers, each with a SwiGLU FFN, in two
layouts: attention at layers 1 and 3 of 4 (a block ``[mamba2, mha]`` scanned twice) and at
layer 2 of 5 (irregular: a prefix ``[mamba2, mamba2, mha]`` unrolled, then ``[mamba2]``
twice). Mamba-2 has two groups of B and C, so its gated RMSNorm is per group; RoPE rotates
half of each head, Bamba's fixed setting.

Falcon-H1 runs attention and Mamba-2 side by side in every layer (parallel mixers, summed),
with every muP multiplier away from 1 (folded into the weights on load) and a Mamba-2 inner
width other than ``expand * hidden_size``; its three gate placements (no norm, the norm
before the gate, after it), a tied head among them.

Nemotron-H's one-sub-layer layers ``M - M * -`` twice pair into attnlab blocks ``[mamba2 +
FFN, mamba2, mha + FFN]`` scanned twice: attention without positions, squared-ReLU MLPs.
Skipped without transformers and torch (the ``hf`` extra)."""

import numpy as np
import pytest
from hf_reference import built_once, hf_logits, tiny_model, transformers
from test_export_hf import export_round_trips
from test_pretrained import max_diff
from test_pretrained_hf import perturb
from test_pretrained_open import greedy_matches_transformers, left_padded
from test_pretrained_ssm import perturb_ssm

from attnlab.pretrained import convert, load_pretrained, read_tensors
from attnlab.pretrained.configs import model_config_from_hf
from attnlab.pretrained.hf_base import UnsupportedCheckpointError, prefix_and_block

TOL = 1e-4
V = 96
# GQA 4:2 with head 8; Mamba-2 of 8 heads of 8 in two groups, state 8, chunks of 8 so a
# prompt spans several.
BAMBA = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
    initializer_range=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)  # fmt: skip
# Every multiplier of Falcon-H1's muP away from 1 (folded into the weights on load); a
# Mamba-2 inner width (mamba_d_ssm 48) other than expand * hidden_size (64), 6 heads of 8.
FALCON_H1 = dict(
    BAMBA, num_hidden_layers=2, attn_layer_indices=None, mamba_d_ssm=48, mamba_n_heads=6,
    lm_head_multiplier=0.5, embedding_multiplier=2.0, mlp_multipliers=[1.5, 0.7],
    key_multiplier=0.8, attention_in_multiplier=1.3, attention_out_multiplier=0.6,
    ssm_multipliers=[1.2, 0.9, 1.1, 0.8, 1.4], ssm_in_multiplier=1.25, ssm_out_multiplier=0.75,
)  # fmt: skip
M, A, MLP = "linear_attention", "full_attention", "mlp"
# Nemotron-H's one-sub-layer layers: Mamba-2 with an MLP after it, Mamba-2 alone, attention
# (no positions) with an MLP, twice: attnlab's blocks [mamba2 + FFN, mamba2, mha + FFN] x 2.
# Its Mamba-2 inner width is heads x head (6 x 8), apart from expand; the MLP squared ReLU.
NEMOTRON_H = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, layers_block_type=[M, MLP, M, A, MLP] * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    mamba_num_heads=6, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4,
    chunk_size=8, expand=2, initializer_range=0.25, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
BASES = {"Bamba": BAMBA, "FalconH1": FALCON_H1, "NemotronH": NEMOTRON_H}
# name -> (family, config changes)
CHECKPOINTS = {
    "regular": ("Bamba", {}),
    "irregular": ("Bamba", {"num_hidden_layers": 5, "attn_layer_indices": [2]}),
    "nemotron_h": ("NemotronH", {}),
    # Mamba-2 without its gated RMSNorm (transformers' default): y * silu(z).
    "falcon_h1": ("FalconH1", {}),
    # The gated RMSNorm before the gate (mamba_norm_before_gate's default); a tied head.
    "falcon_h1_norm_then_gate": ("FalconH1", {"mamba_rms_norm": True, "tie_word_embeddings": True}),
    "falcon_h1_gate_then_norm": (
        "FalconH1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``name -> (transformers model, folder)`` of ``CHECKPOINTS[name]``, built once."""

    def build(name):
        family, changes = CHECKPOINTS[name]
        config = getattr(transformers, f"{family}Config")(**{**BASES[family], **changes})
        perturbs = (perturb, 161), (perturb_ssm, 261)
        return tiny_model(
            f"{family}ForCausalLM", config, 61, *perturbs, attn_implementation="eager"
        )

    return built_once(tmp_path_factory, build)


def logits_match(model, folder):
    """The loaded checkpoint's logits against transformers' at the real positions of a
    left-padded batch; returns the handle, the ids, the real positions and the expected
    logits there."""
    ids, mask = left_padded(np.random.default_rng(0))
    real = mask.astype(bool)
    expected = hf_logits(model, ids, mask)[real]
    handle = load_pretrained(folder)
    assert handle.family == model.config.model_type
    diff = max_diff(np.asarray(handle.logits(ids, mask))[real], expected)
    assert diff <= TOL, diff
    return handle, ids, real, expected


def test_bamba_logits_match_transformers_with_left_padding(checkpoints):
    handle, *_ = logits_match(*checkpoints("regular"))
    pattern, cfg = handle.config.block_pattern, handle.config
    assert [k.mixers[0].mixer for k in pattern.block] == ["mamba2", "mha"] and not pattern.prefix
    assert cfg.rotary_dim == 4 and cfg.block_pattern.block[0].mixers[0].mixer_settings.n_groups == 2


@pytest.mark.slow(reason="a second Bamba checkpoint built and compiled, and two variants")
def test_bamba_with_an_irregular_layout_loads_it_as_a_prefix_and_its_features_matter(checkpoints):
    model, folder = checkpoints("irregular")
    handle, ids, real, expected = logits_match(model, folder)
    pattern = handle.config.block_pattern
    assert [k.mixers[0].mixer for k in pattern.prefix] == ["mamba2", "mamba2", "mha"]
    assert [k.mixers[0].mixer for k in pattern.block] == ["mamba2"]
    # Half the head rotates: rotating all of it moves the logits.
    tensors = read_tensors(folder)
    other = convert(handle.hf_config, tensors, handle.config.replace(rotary_dim=None))
    assert max_diff(other(ids, valid_BT=real).logits[real], expected) > 1e-3


@pytest.mark.slow(reason="cached decoding of a Bamba checkpoint, compiled, against generate")
def test_bamba_greedy_with_cache_matches_transformers(checkpoints):
    greedy_matches_transformers(*checkpoints("regular"))


def test_layer_kinds_become_the_shortest_prefix_and_repeating_block():
    M, A = "m", "a"
    assert prefix_and_block([M, A, M, A]) == {"prefix": [], "block": [M, A]}
    assert prefix_and_block([M, M, A, M, M]) == {"prefix": [M, M, A], "block": [M]}
    assert prefix_and_block([M] * 4) == {"prefix": [], "block": [M]}
    # Bamba 9B: attention at 9, 18 and 27 of 32, so layers 5.. repeat every 9.
    kinds = [A if i in (9, 18, 27) else M for i in range(32)]
    assert prefix_and_block(kinds) == {"prefix": kinds[:5], "block": kinds[5:14]}
    assert prefix_and_block([A, M, M, A, M, M]) == {"prefix": [], "block": [A, M, M]}


def test_bamba_config_defaults_half_rotary_and_refuses_what_attnlab_cannot_load():
    config = transformers.BambaConfig(**BAMBA).to_dict()
    config["rope_parameters"].pop("partial_rotary_factor")  # older files: transformers' 0.5
    assert model_config_from_hf(config).rotary_dim == 4
    for change, match in (
        ({"attn_layer_indices": [4]}, r"attn_layer_indices=\[4\].*num_hidden_layers=4"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias=True"),
    ):
        with pytest.raises(UnsupportedCheckpointError, match=match):
            model_config_from_hf({**config, **change})


@pytest.mark.slow(reason="a third export round trip; Qwen3-Next's and Mamba-2's run fast")
def test_bamba_exports_and_round_trips(checkpoints, tmp_path):
    export_round_trips(*checkpoints("regular"), tmp_path / "hf")


def test_falcon_h1_logits_match_transformers_with_left_padding(checkpoints):
    handle, *_ = logits_match(*checkpoints("falcon_h1"))
    (kind,) = handle.config.block_pattern.block
    assert [m.mixer for m in kind.mixers] == ["mha", "mamba2"]
    s = kind.mixers[1].mixer_settings
    assert (s.d_inner, s.num_heads, s.norm) == (48, 6, "none")


@pytest.mark.slow(reason="two more Falcon-H1 checkpoints built and compiled, one more variant")
@pytest.mark.parametrize("name", ["falcon_h1_norm_then_gate", "falcon_h1_gate_then_norm"])
def test_falcon_h1_gated_norms_match_and_the_multipliers_matter(checkpoints, name):
    model, folder = checkpoints(name)
    handle, ids, real, expected = logits_match(model, folder)
    norm = handle.config.block_pattern.block[0].mixers[1].mixer_settings.norm
    assert norm == name.removeprefix("falcon_h1_")
    if name == "falcon_h1_norm_then_gate":  # muP folded: read without it, the logits move
        plain = {k: v for k, v in handle.hf_config.items() if "multiplier" not in k}
        other = convert(plain, read_tensors(folder), handle.config.replace(logits_scale=1.0))
        assert max_diff(other(ids, valid_BT=real).logits[real], expected) > 1e-3


@pytest.mark.slow(reason="cached decoding of a Falcon-H1 checkpoint, compiled, against generate")
def test_falcon_h1_greedy_with_cache_matches_transformers(checkpoints):
    greedy_matches_transformers(*checkpoints("falcon_h1"))


def test_nemotron_h_logits_match_transformers_with_left_padding(checkpoints):
    handle, *_ = logits_match(*checkpoints("nemotron_h"))
    cfg = handle.config
    kinds = [(k.mixers[0].mixer, k.ffn_variant) for k in cfg.block_pattern.block]
    assert kinds == [("mamba2", None), ("mamba2", "none"), ("mha", None)]
    assert cfg.n_layers == 6 and cfg.position == "none" and cfg.ffn == "relu2"


@pytest.mark.slow(reason="cached decoding of a Nemotron-H checkpoint, compiled, and a variant")
def test_nemotron_h_greedy_with_cache_matches_and_its_squared_relu_matters(checkpoints):
    model, folder = checkpoints("nemotron_h")
    greedy_matches_transformers(model, folder)
    ids, mask = left_padded(np.random.default_rng(0))
    real = mask.astype(bool)
    expected = hf_logits(model, ids, mask)[real]
    handle = load_pretrained(folder)
    other = convert(handle.hf_config, read_tensors(folder), handle.config.replace(ffn="relu"))
    assert max_diff(other(ids, valid_BT=real).logits[real], expected) > 1e-3


def test_nemotron_h_config_reads_the_pattern_letters_and_refuses_what_does_not_pair():
    config = transformers.NemotronHConfig(**NEMOTRON_H).to_dict()
    letters = {**config, "layers_block_type": None, "hybrid_override_pattern": "M-M*-M-M*-"}
    assert model_config_from_hf(letters).block_pattern == model_config_from_hf(config).block_pattern
    for types, where in (
        ([MLP, M], "layers_block_type\\[0\\]='mlp'"),
        ([M, "moe"], "\\[1\\]='moe'"),
    ):
        with pytest.raises(UnsupportedCheckpointError, match=where):
            model_config_from_hf({**config, "layers_block_type": types})


@pytest.mark.parametrize(
    "minimal",
    [
        {"model_type": "bamba", "attn_layer_indices": [1]},
        {"model_type": "falcon_h1"},
        # NemotronHConfig's older keys: the pattern's letters, mamba_n_groups.
        {"model_type": "nemotron_h", "hybrid_override_pattern": "M-*-", "mamba_n_groups": 2},
    ],
)
def test_a_config_json_that_leaves_keys_out_reads_as_transformers_fills_them(minimal):
    minimal = dict(
        minimal, vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        intermediate_size=48,
    )  # fmt: skip
    classes = {
        "bamba": "BambaConfig",
        "falcon_h1": "FalconH1Config",
        "nemotron_h": "NemotronHConfig",
    }
    kwargs = {k: v for k, v in minimal.items() if k != "model_type"}
    full = getattr(transformers, classes[minimal["model_type"]])(**kwargs).to_dict()
    assert model_config_from_hf(minimal) == model_config_from_hf(full)
