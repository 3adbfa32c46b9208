"""Qwen3-MoE checkpoints whose config keeps dense FFNs in some layers (``mlp_only_layers``,
``decoder_sparse_step`` > 1): the layers transformers builds dense are dense in attnlab, the
logits of a left-padded batch agree to 1e-4, greedy tokens through attnlab's cache equal
``model.generate``, and the loaded model exports back to a folder transformers reads with
the same logits."""

import numpy as np
import pytest
from hf_reference import built_once, hf_logits, tiny_model, torch, transformers
from test_export_hf import transformers_logits
from test_pretrained import max_diff
from test_pretrained_hf import perturb
from test_pretrained_moe import SPECS, TOL
from test_pretrained_open import greedy_matches_transformers, left_padded

from attnlab.config.layer_kinds import stack_plan
from attnlab.pretrained import export_model, load_pretrained
from attnlab.pretrained.configs import model_config_from_hf

# Sparse in layers 1 and 3 (decoder_sparse_step 2), layer 3 listed dense as well: dense,
# sparse, dense, dense. A regular alternation: dense, sparse, dense, sparse.
INTERLEAVED = {
    "listed": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]),
    "alternating": dict(num_hidden_layers=4, decoder_sparse_step=2),
    "first": dict(num_hidden_layers=3, mlp_only_layers=[0]),
}


def _config(case):
    return transformers.Qwen3MoeConfig(**{**SPECS["qwen3_moe"][2], **INTERLEAVED[case]})


def _dense_layers_of(model) -> list[bool]:
    """Which layers transformers built with a plain MLP (no router)."""
    return [not hasattr(layer.mlp, "gate") for layer in model.model.layers]


@pytest.mark.parametrize("case", list(INTERLEAVED))
def test_the_layers_transformers_builds_dense_are_dense(case):
    config = _config(case)
    model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.float32)
    ours = model_config_from_hf({**config.to_dict(), "model_type": "qwen3_moe"})
    kinds = stack_plan(ours, ours.n_layers).kinds
    assert [k.ffn_variant == "dense" for k in kinds] == _dense_layers_of(model)
    assert any(_dense_layers_of(model)) and not all(_dense_layers_of(model))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    build = lambda case: tiny_model(
        "Qwen3MoeForCausalLM", _config(case), 7, (perturb, 8), attn_implementation="eager"
    )
    return built_once(tmp_path_factory, build)


@pytest.mark.slow(reason="a mixture-of-experts checkpoint built, loaded, decoded, exported")
@pytest.mark.parametrize("case", ["listed", "alternating"])
def test_interleaved_checkpoint_loads_decodes_and_exports_as_transformers(
    checkpoint, tmp_path, case
):
    model, folder = checkpoint(case)
    ids, mask = left_padded(np.random.default_rng(0))
    real = mask.astype(bool)
    expected = hf_logits(model, ids, mask)
    handle = load_pretrained(folder)
    assert handle.family == "qwen3_moe"
    assert max_diff(np.asarray(handle.logits(ids, mask))[real], expected[real]) <= TOL
    greedy_matches_transformers(model, folder)
    assert export_model(handle.model, tmp_path / "hf") == "qwen3_moe"
    assert max_diff(transformers_logits(tmp_path / "hf", ids, mask)[real], expected[real]) <= TOL


def test_a_sparse_step_below_one_is_refused_naming_the_key():
    from attnlab.pretrained.hf_base import UnsupportedCheckpointError

    c = {**_config("alternating").to_dict(), "model_type": "qwen3_moe", "decoder_sparse_step": 0}
    with pytest.raises(UnsupportedCheckpointError, match="decoder_sparse_step=0"):
        model_config_from_hf(c)
