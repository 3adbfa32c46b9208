"""Qwen3-Next checkpoints that transformers writes (``Qwen3NextForCausalLM``): a tiny random
model saved with ``save_pretrained`` and loaded by attnlab as a hybrid stack whose block is a
Gated DeltaNet layer and a gated attention layer, repeated twice (so block position ``p``
and repeat ``r`` read the checkpoint's layer ``2r + p``), each with four experts (two per
token) and a gated shared expert; logits ≤ 1e-4 at the real positions of a left-padded
batch, and 16 greedy tokens through attnlab's cache equal to ``model.generate``.

The reference is transformers' model in float64 (its float32 forward is itself 2.3e-4 from
its float64 one on these weights, attnlab's float32 3e-5). In float64 transformers' left
padding turns into NaN (the eager attention's fully masked pad rows, carried by the next
linear-attention layer), so the padded row is compared with its real tokens run alone; the
float32 padded batch is compared too, within transformers' own float32 error. The loaded
checkpoint exported again (``export_model``) reads in transformers with the original's
logits and back in attnlab with the same parameters bit for bit. Skipped without
transformers and torch (the ``hf`` extra)."""

import numpy as np
import pytest
from hf_reference import tiny_model, torch, transformers
from test_export_hf import export_round_trips
from test_pretrained import max_diff
from test_pretrained_hf import hf, perturb
from test_pretrained_open import greedy_matches_transformers, left_padded

from attnlab.pretrained import convert, load_pretrained, read_tensors
from attnlab.pretrained.configs import model_config_from_hf
from attnlab.pretrained.hf_base import UnsupportedCheckpointError

TOL = 1e-4
V = 96
# GQA 4:2 with head 16 and rotary on a quarter of it; Gated DeltaNet with 4 value heads
# over 2 key heads; 4 experts of width 24, 2 per token, a shared expert of width 40.
QWEN3_NEXT = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25,
    max_position_embeddings=64, layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=True,
    initializer_range=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.Qwen3NextConfig(**QWEN3_NEXT)
    model = tiny_model(
        "Qwen3NextForCausalLM", config, 51, (perturb, 151), attn_implementation="eager"
    )
    folder = tmp_path_factory.mktemp("qwen3_next")
    model.save_pretrained(folder)
    exact = transformers.Qwen3NextForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float64
    )
    exact.load_state_dict(model.state_dict())
    exact.eval()
    exact.generation_config.eos_token_id = None
    return model, exact, folder


def test_qwen3_next_logits_match_transformers_with_left_padding(checkpoint):
    model, exact, folder = checkpoint
    ids, mask = left_padded(np.random.default_rng(0))
    real = mask.astype(bool)
    with torch.no_grad():
        padded32 = model(hf(ids), attention_mask=hf(mask)).logits.numpy()
        rows = [exact(hf(row[m][None])).logits.numpy()[0] for row, m in zip(ids, real, strict=True)]
    expected = np.concatenate(rows).astype(np.float32)  # the real positions, row by row
    handle = load_pretrained(folder)
    cfg = handle.config
    assert handle.family == "qwen3_next" and cfg.ffn_variant == "moe"
    kinds = [k.mixers[0].mixer for k in cfg.block_pattern.block]
    assert kinds == ["gated_deltanet", "gated"] and cfg.rotary_dim == 4
    ours = np.asarray(handle.logits(ids, mask))[real]
    assert max_diff(ours, expected) <= TOL
    assert max_diff(ours, padded32[real]) <= 5 * TOL
    # The multi-token-prediction head that full checkpoints carry is left unread, and the
    # gated RMSNorm's plain scale matters: read as 1 + w, the logits move.
    tensors = read_tensors(folder)
    tensors["mtp.fc.weight"] = np.zeros((32, 64), np.float32)
    norm = "model.layers.2.linear_attn.norm.weight"
    tensors[norm] = tensors[norm] - 1
    moved = convert(handle.hf_config, tensors, cfg)(ids, valid_BT=real).logits
    assert max_diff(np.asarray(moved)[real], expected) > 1e-3


@pytest.mark.slow(reason="cached decoding of a Qwen3-Next checkpoint, compiled, against generate")
def test_qwen3_next_greedy_with_cache_matches_transformers(checkpoint):
    _, exact, folder = checkpoint
    greedy_matches_transformers(exact, folder)


def test_qwen3_next_config_reads_the_repeating_block_and_refuses_what_attnlab_cannot_load():
    # transformers' default layer_types: every fourth layer full attention.
    kwargs = {**QWEN3_NEXT, "num_hidden_layers": 8, "layer_types": None}
    config = transformers.Qwen3NextConfig(**kwargs).to_dict()
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    assert config["layer_types"] == kinds * 2
    cfg = model_config_from_hf(config)
    block = cfg.block_pattern.block
    assert [k.mixers[0].mixer for k in block] == ["gated_deltanet"] * 3 + ["gated"]
    s = block[0].mixers[0].mixer_settings
    assert (s.num_v_heads, s.num_k_heads, s.head_k_dim, s.head_v_dim) == (4, 2, 8, 8)
    f = cfg.ffn_settings
    assert (f.n_experts, f.top_k, f.d_expert, f.n_shared, f.d_shared, f.shared_gate) == (
        4, 2, 24, 1, 40, True,
    )  # fmt: skip
    # A config.json without layer_types is read with the same default.
    assert model_config_from_hf({**config, "layer_types": None}).block_pattern == cfg.block_pattern
    for change, match in (
        ({"layer_types": ["sliding_attention"] * 8}, "layer_types=.*'full_attention'"),
        ({"layer_types": kinds}, "num_hidden_layers=8 entries"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\]"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ):
        with pytest.raises(UnsupportedCheckpointError, match=match):
            model_config_from_hf({**config, **change})


def test_qwen3_next_exports_and_round_trips(checkpoint, tmp_path):
    model, _, folder = checkpoint
    export_round_trips(model, folder, tmp_path / "hf")
