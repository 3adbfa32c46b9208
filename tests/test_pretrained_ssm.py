"""Mamba-2 checkpoints that transformers writes (``Mamba2ForCausalLM``): a tiny random model
saved with ``save_pretrained`` and loaded by attnlab as a decoder of ``mamba2`` layers
without FFN (``ffn_variant="none"``); logits ≤ 1e-4 at the real positions of a left-padded
batch, and 16 greedy tokens through attnlab's cache equal to ``model.generate``. Skipped
without transformers and torch (the ``hf`` extra)."""

import numpy as np
import pytest
from hf_reference import hf_logits, tiny_model, torch, transformers
from test_export_hf import export_round_trips
from test_pretrained import max_diff
from test_pretrained_hf import perturb
from test_pretrained_open import greedy_matches_transformers, left_padded

from attnlab.errors import ConfigError
from attnlab.pretrained import load_pretrained
from attnlab.pretrained.configs import model_config_from_hf

TOL = 1e-4
V = 96
# Two groups of B and C shared by 4 heads each; chunks of 8 so a prompt spans several.
MAMBA2 = dict(
    vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
    state_size=8, n_groups=2, expand=2, conv_kernel=4, chunk_size=8, use_conv_bias=True,
    initializer_range=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)  # fmt: skip


@torch.no_grad()
def perturb_ssm(model, gen):
    """Decays and skips away from their init (A = -1..-N, D = 1), larger conv taps."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(0.5 + 3 * torch.rand(p.shape, generator=gen)))
        elif name.endswith(".D"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("conv1d.weight"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.Mamba2Config(**MAMBA2)
    model = tiny_model("Mamba2ForCausalLM", config, 41, (perturb, 141), (perturb_ssm, 241))
    folder = tmp_path_factory.mktemp("mamba2")
    model.save_pretrained(folder)
    return model, folder


def test_mamba2_logits_match_transformers_with_left_padding(checkpoint):
    model, folder = checkpoint
    ids, mask = left_padded(np.random.default_rng(0))
    expected = hf_logits(model, ids, mask)
    handle = load_pretrained(folder)
    cfg = handle.config
    assert handle.family == "mamba2" and cfg.mixer == "mamba2" and cfg.ffn_variant == "none"
    real = mask.astype(bool)
    diff = max_diff(np.asarray(handle.logits(ids, mask))[real], expected[real])
    assert diff <= TOL, diff


@pytest.mark.slow(reason="cached decoding of a Mamba-2 checkpoint, compiled, against generate")
def test_mamba2_greedy_with_cache_matches_transformers(checkpoint):
    model, folder = checkpoint
    greedy_matches_transformers(model, folder)


def test_mamba2_config_refuses_what_attnlab_cannot_compute_and_no_ffn_needs_pre_norm():
    config = transformers.Mamba2Config(**MAMBA2).to_dict()
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        model_config_from_hf({**config, "hidden_act": "gelu"})
    cfg = model_config_from_hf(config)
    assert cfg.mixer_settings.dt_limit_max is None and cfg.mixer_settings.chunk_size == 8
    with pytest.raises(ConfigError, match="norm_placement='post'.*ffn_variant='none'"):
        cfg.replace(norm_placement="post")


def test_mamba2_exports_and_round_trips(checkpoint, tmp_path):
    export_round_trips(*checkpoint, tmp_path / "hf")
