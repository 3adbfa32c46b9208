"""muP and CompleteP (attnlab.nn.parametrization): the multipliers against a table written by
hand from Tensor Programs V (Adam) and the spectral condition (Muon), the base width equal to
the standard parametrisation bitwise, the standard form that exports, the coordinate check,
and the bad inputs."""

import math

import jax
import numpy as np
import pytest

from attnlab import experiment
from attnlab.config import ModelConfig
from attnlab.contracts.mixer import registered_mixers
from attnlab.errors import ConfigError
from attnlab.experiment import ExperimentError
from attnlab.nn import parametrization as P
from attnlab.nn.models import build_model, init_params
from attnlab.sweep import coord_check
from attnlab.train.optim import make_optimizer

SMALL = dict(vocab_size=32, n_layers=2, n_heads=2, max_len=16, position="learned",
             tie_embeddings=False, ffn="gelu")  # fmt: skip
M = 2.0  # width 64 over base width 32
# (role, init multiplier, AdamW rate multiplier, Muon rate multiplier), by hand for m = 2:
# hidden matrices 1/sqrt(m) and 1/m (Adam), 1 under Muon (fan-out over fan-in unchanged);
# the head keeps its init and Adam rate (its forward carries 1/m) and under Muon takes
# sqrt(fan_out/fan_in) = sqrt(32/64) over optax's max(1, .) = 1, times m: sqrt(2).
TABLE = {
    "embed.tokens.embedding_VD": ("input", 1.0, 1.0, 1.0),
    "decoder.positions.table_PD": ("input", 1.0, 1.0, 1.0),
    "decoder.layers.attn.q_DNH": ("hidden", M**-0.5, 1 / M, 1.0),
    "decoder.layers.attn.k_DKH": ("hidden", M**-0.5, 1 / M, 1.0),
    "decoder.layers.attn.v_DKH": ("hidden", M**-0.5, 1 / M, 1.0),
    "decoder.layers.attn.o_NHD": ("hidden", M**-0.5, 1 / M, 1.0),
    "decoder.layers.ffn.w_in_DF": ("hidden", M**-0.5, 1 / M, 1.0),
    "decoder.layers.ffn.w_out_FD": ("hidden", M**-0.5, 1 / M, 1.0),
    "decoder.layers.attn_norm.scale_D": ("vector", 1.0, 1.0, 1.0),
    "decoder.layers.attn_norm.bias_D": ("vector", 1.0, 1.0, 1.0),
    "decoder.layers.ffn_norm.scale_D": ("vector", 1.0, 1.0, 1.0),
    "decoder.layers.ffn_norm.bias_D": ("vector", 1.0, 1.0, 1.0),
    "decoder.final_norm.scale_D": ("vector", 1.0, 1.0, 1.0),
    "decoder.final_norm.bias_D": ("vector", 1.0, 1.0, 1.0),
    "head.head_DV": ("head", 1.0, 1.0, math.sqrt(2.0)),
}


def _cfg(width=64, parametrization="mup", **kw):
    return ModelConfig(d_model=width, parametrization=parametrization, base_width=32,
                       **{**SMALL, **kw})  # fmt: skip


def _flat(tree):
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        out[".".join(k for k in keys if k not in ("value", "raw_value"))] = x
    return out


def _optim(name):
    o = experiment.base_config().optim
    o.update(name=name, learning_rate=1e-2, adam_learning_rate=1e-2, weight_decay=0.0,
             warmup_steps=0, schedule="constant", clip_norm=0.0)  # fmt: skip
    return o


def _one_update(cfg, name, params, grads):
    tx = make_optimizer(_optim(name), 10, params, cfg)
    updates, _ = tx.update(grads, tx.init(params), params)
    return _flat(updates)


def test_mup_multipliers_match_the_hand_written_table_for_adamw_and_muon():
    rows = {r["path"]: r for r in P.table(_cfg(), "adam")}
    muon_rows = {r["path"]: r for r in P.table(_cfg(), "muon")}
    assert set(rows) == set(TABLE)
    for path, (role, init, adam, muon) in TABLE.items():
        assert rows[path]["role"] == role, path
        assert rows[path]["init"] == pytest.approx(init, rel=1e-15), path
        assert rows[path]["lr"] == pytest.approx(adam, rel=1e-15), path
        assert muon_rows[path]["lr"] == pytest.approx(muon, rel=1e-15), path


@pytest.mark.slow(reason="initialises two models and compiles two optimisers' updates")
def test_initial_parameters_and_updates_follow_the_table():
    """What the multipliers do: the same draws scaled (float64 ratios), the same gradients
    giving updates in the table's ratios, for AdamW and Muon."""
    mup, sp = _cfg(), _cfg(parametrization="standard")
    mup_params, sp_params = init_params(mup, np.uint32(3)), init_params(sp, np.uint32(3))
    a, b = _flat(mup_params), _flat(sp_params)
    for path, (_, init, _, _) in TABLE.items():
        x, y = np.asarray(a[path], np.float64), np.asarray(b[path], np.float64)
        if np.any(y):
            np.testing.assert_allclose(x[y != 0] / y[y != 0], init, rtol=1e-6, err_msg=path)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), sp_params)
    for name, column in (("adamw", 2), ("muon", 3)):
        u_mup = _one_update(mup, name, sp_params, grads)
        u_sp = _one_update(sp, name, sp_params, grads)
        for path, entry in TABLE.items():
            x, y = np.asarray(u_mup[path], np.float64), np.asarray(u_sp[path], np.float64)
            np.testing.assert_allclose(x, entry[column] * y, rtol=2e-6, atol=1e-12,
                                       err_msg=f"{name} {path}")  # fmt: skip


def test_forward_multipliers_are_one_over_d_attention_and_the_readout():
    cfg = _cfg(width=128)  # head_dim 64 against 16 at the base
    assert cfg.attn_scale == pytest.approx(math.sqrt(16) / 64, rel=1e-15)
    assert P.readout_multiplier(cfg) == 32 / 128
    deep = _cfg(width=32, parametrization="completep", n_layers=8, base_depth=2)
    assert P.residual_multiplier(deep) == 2 / 8


@pytest.mark.slow(reason="initialises, runs and updates three tiny models, two optimisers")
def test_at_the_base_width_and_depth_mup_and_completep_are_standard_bitwise():
    sp = _cfg(width=32, parametrization="standard")
    tokens = np.arange(24).reshape(2, 12) % 32
    p_sp = init_params(sp, np.uint32(1))
    logits_sp = np.asarray(build_model(sp, seed=1)(tokens).logits)
    rng = np.random.default_rng(1)
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), p_sp)
    for name in ("mup", "completep"):
        cfg = _cfg(width=32, parametrization=name, base_depth=2)
        assert cfg.attn_scale == sp.attn_scale
        p = init_params(cfg, np.uint32(1))
        for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(p_sp), strict=True):
            assert np.array_equal(x, y)
        assert np.array_equal(np.asarray(build_model(cfg, seed=1)(tokens).logits), logits_sp)
        for optimizer in ("adamw", "muon"):
            u, u_sp = (_one_update(c, optimizer, p_sp, grads) for c in (cfg, sp))
            assert all(np.array_equal(u[k], u_sp[k]) for k in u_sp), (name, optimizer)


@pytest.mark.slow(reason="builds a model, its standard form and an export")
def test_the_standard_form_computes_the_same_and_exports_as_llama(tmp_path):
    cfg = _cfg(width=128, parametrization="completep", n_layers=4, base_depth=2,
               position="rope", norm="rmsnorm", norm_bias=False, ffn="swiglu")  # fmt: skip
    model = build_model(cfg, seed=0)
    standard = P.to_standard(model)
    assert standard.cfg.parametrization == "standard" and standard.cfg.residual_scale == 0.5
    tokens = np.arange(20).reshape(2, 10) % 32
    # Widths a power of four over the base fold exactly: the same logits, bitwise.
    assert np.array_equal(np.asarray(model(tokens).logits), np.asarray(standard(tokens).logits))
    mup = build_model(cfg.replace(parametrization="mup", base_depth=None), seed=0)
    from attnlab.pretrained.export import export_model

    assert export_model(mup, tmp_path / "hf") == "llama"


@pytest.mark.slow(reason="reads the parameter shapes of every mixer at three widths")
def test_every_registered_mixer_and_architecture_has_roles_and_a_standard_base():
    for name in registered_mixers():
        cfg = ModelConfig(d_model=32, n_heads=2, n_layers=1, vocab_size=16, max_len=8,
                          mixer=name, position="rope" if name != "mha" else "learned",
                          parametrization="mup", base_width=16)  # fmt: skip
        roles = {r["role"] for r in P.table(cfg, "adam")}
        assert "hidden" in roles and roles <= set(P.ROLES), name
    for arch in ("encoder", "encoder_decoder"):
        cfg = ModelConfig(arch=arch, d_model=32, n_heads=2, n_layers=1, vocab_size=16,
                          max_len=8, parametrization="mup", base_width=16)  # fmt: skip
        hidden = [r for r in P.table(cfg, "adam") if r["role"] == "hidden"]
        assert hidden and all(r["init"] == pytest.approx(0.5**0.5) for r in hidden), arch


def test_bad_inputs_are_one_line_each():
    with pytest.raises(ConfigError, match=r"base_width=50 .*divide into n_heads=4"):
        ModelConfig(d_model=128, n_heads=4, parametrization="mup", base_width=50)
    with pytest.raises(ConfigError, match=r"parametrization='mu_p'"):
        ModelConfig(parametrization="mu_p")
    cfg = experiment.base_config()
    cfg.model.update(parametrization="mup", base_width=64)
    cfg.optim.name = "lamb"
    with pytest.raises(ExperimentError, match=r"optim.name='lamb'.*no learning-rate rule"):
        experiment.validate(cfg)
    with pytest.raises(ConfigError, match=r"optim.name='lamb' has no learning-rate rule"):
        shapes = jax.eval_shape(lambda: init_params(_cfg(), np.uint32(0)))
        make_optimizer(_optim("lamb"), 10, shapes, _cfg())


@pytest.mark.slow(reason="trains 6 tiny models for 3 steps each, one program each")
def test_the_coordinate_check_is_flat_under_mup_and_grows_under_standard():
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_len=16,
                      position="rope", norm="rmsnorm", norm_bias=False)  # fmt: skip
    result = coord_check.coordinate_check(cfg, [16, 32, 64], steps=3, learning_rate=1e-2,
                                          batch_size=4, seq_len=8)  # fmt: skip
    slopes = coord_check.slopes(result)
    assert abs(slopes[("mup", "layer0", 3)]) < 0.15
    assert slopes[("standard", "layer0", 3)] > 0.6


@pytest.mark.slow(reason="eager optax steps of eight optimisers: many small dispatches")
def test_every_registered_optimizer_keeps_its_rates_in_the_state_and_steps():
    """Each optimiser a sweep may name holds its peak rate in the state (so its trials stack)
    and takes a finite step on a weight matrix, a norm scale and an embedding."""
    from attnlab.contracts.optimizer import OPTIMIZERS
    from attnlab.train.optim import injected_hyperparams, set_optim_values

    params = {"w_in_DF": np.ones((4, 6), np.float32), "scale_D": np.ones((4,), np.float32),
              "embedding_VD": np.ones((5, 4), np.float32)}  # fmt: skip
    grads = jax.tree.map(lambda x: np.full_like(x, 0.5), params)
    for name in OPTIMIZERS:
        o = _optim(name)
        tx = make_optimizer(o, 10, params)
        state = tx.init(params)
        o.learning_rate = 3e-3
        set_optim_values(state, o)
        assert float(injected_hyperparams(state)["learning_rate"]) == pytest.approx(3e-3), name
        updates, _ = tx.update(grads, state, params)
        assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(updates)), name
        assert any(np.any(u != 0) for u in jax.tree.leaves(updates)), name
