"""The optimiser and schedule registries: a registered optimiser is built from the config
and trains by its own rule; names not registered are refused naming the field."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab import experiment
from attnlab.contracts.optimizer import OPTIMIZERS, SCHEDULES, register_optimizer, register_schedule
from attnlab.train.optim import injected_hyperparams, make_optimizer, set_optim_values


@pytest.fixture
def plain_sgd():
    @register_optimizer("plain_sgd", state_names={"b1": "momentum"})
    def build(o, params, mask):
        return optax.inject_hyperparams(optax.sgd)(learning_rate=o.learning_rate, momentum=o.b1)

    @register_schedule("halving")
    def halving(o, frac):
        return 1.0 - 0.5 * frac

    yield
    del OPTIMIZERS["plain_sgd"], SCHEDULES["halving"]


def test_a_registered_optimiser_and_schedule_update_by_their_own_rule(plain_sgd):
    o = experiment.base_config().optim
    o.name, o.schedule, o.warmup_steps, o.clip_norm = "plain_sgd", "halving", 0, 0.0
    o.learning_rate, o.b1 = 0.1, 0.0
    params = {"w_DF": jnp.ones((2, 3))}
    grads = {"w_DF": jnp.full((2, 3), 2.0)}
    opt = make_optimizer(o, total_steps=11, params=params)
    state = opt.init(params)
    for step in range(3):
        updates, state = opt.update(grads, state, params)
        # SGD: -lr * g; the schedule falls linearly from 1 at step 0 to 0.5 at the 11th step
        expect = -0.1 * 2.0 * (1.0 - 0.5 * step / 11)
        np.testing.assert_allclose(np.asarray(updates["w_DF"]), expect, rtol=1e-6)
    o.b1 = 0.5  # kept in the state under the optimiser's own name
    set_optim_values(state, o)
    assert float(injected_hyperparams(state)["momentum"]) == 0.5


@pytest.mark.parametrize(
    "field, value, listed",
    [
        ("name", "adamax_typo", "'adamw', 'lamb', 'lion', 'muon'"),
        ("schedule", "cosinus", "'constant', 'cosine'"),
    ],
)
def test_names_not_registered_are_refused_naming_the_field(field, value, listed):
    cfg = experiment.base_config()
    cfg.optim[field] = value
    with pytest.raises(experiment.ConfigError, match=rf"optim\.{field}.*{listed}"):
        experiment.validate(cfg)


def layer(tree):
    return tree["decoder"]["layers"]["attn"]


def value(tree):
    return {k: v.get_value() for k, v in layer(tree).items()}


@pytest.mark.slow(reason="builds both recurrent mixers and runs optax's Muon beside ours")
def test_muon_leaves_recurrent_conv_kernels_and_vectors_to_adam():
    """Gated DeltaNet's and Mamba-2's short-convolution kernels ``conv_WZ`` (one depthwise
    filter per channel) and their per-head vectors are no matrices: Muon's reading is None
    and their update is Adam's (Nesterov Adam's first step moves every entry by
    ``lr * (1 + b1 / (1 + b1))``), while the projections are orthogonalised; weight decay
    skips the vectors and keeps the matrices and kernels."""
    import jax
    from flax import nnx

    from attnlab import ModelConfig, build_model
    from attnlab.contracts.optimizer import muon_dimensions
    from attnlab.train.optim import decay_mask

    settings = {
        "gated_deltanet": {"num_k_heads": 2, "head_v_dim": 4, "chunk_size": 4},
        "mamba2": {"state_size": 4, "head_dim": 8, "chunk_size": 4},
    }
    c = experiment.base_config()
    c.optim.update(name="muon", clip_norm=0.0, warmup_steps=0, weight_decay=0.0)
    b1, lr = c.optim.b1, c.optim.adam_learning_rate
    for mixer, s in settings.items():
        cfg = ModelConfig(
            n_layers=2, d_model=16, n_heads=2, vocab_size=11, d_ff=24, position="none",
            mixer=mixer, mixer_settings=s,
        )  # fmt: skip
        params = nnx.state(build_model(cfg), nnx.Param)
        dims, decay = value(muon_dimensions(params)), value(decay_mask(params))
        vectors = ("A_log_N", "dt_bias_N")
        assert dims["conv_WZ"] is None and all(dims[v] is None for v in vectors)
        proj = "in_proj_qkvz_DKH" if mixer == "gated_deltanet" else "in_proj_DZ"
        assert dims[proj] is not None and dims[proj].reduction_axis == (1,)
        assert decay["conv_WZ"] and decay[proj] and not any(decay[v] for v in vectors)

        grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape), params)
        tx = make_optimizer(c.optim, 10, params)
        updates, _ = tx.update(grads, tx.init(params), params)
        conv = np.abs(np.asarray(layer(updates)["conv_WZ"][...]))
        np.testing.assert_allclose(conv, lr * (1 + b1 / (1 + b1)), rtol=1e-3)
        # The projection's layer-0 update is plain optax Muon's on the [D, Z] matrix.
        g = np.asarray(layer(grads)[proj][...][0]).reshape(16, -1)
        plain = optax.contrib.muon(learning_rate=c.optim.learning_rate, beta=c.optim.muon_beta)
        want, _ = plain.update(jnp.asarray(g), plain.init(jnp.asarray(g)), jnp.asarray(g))
        got = np.asarray(layer(updates)[proj][...][0]).reshape(g.shape)
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-6)


def test_muon_ns_steps_reaches_the_orthogonalisation_as_optax_runs_it():
    """``optim.muon_ns_steps`` is the count of Newton-Schulz iterations: the update of one
    ``[D, F]`` matrix equals ``optax.contrib.muon(ns_steps=n)`` on it alone, and 3 differs
    from 5; a count below 1 is refused naming the field."""
    g = {"w_DF": jnp.asarray(np.random.default_rng(0).normal(size=(8, 12)), jnp.float32)}
    got = {}
    for n in (3, 5):
        o = experiment.base_config().optim
        o.update(name="muon", clip_norm=0.0, warmup_steps=0, weight_decay=0.0, muon_ns_steps=n)
        tx = make_optimizer(o, 10, g)
        got[n] = np.asarray(tx.update(g, tx.init(g), g)[0]["w_DF"])
        plain = optax.contrib.muon(learning_rate=o.learning_rate, beta=o.muon_beta, ns_steps=n)
        want, _ = plain.update(g["w_DF"], plain.init(g["w_DF"]), g["w_DF"])
        np.testing.assert_allclose(got[n], np.asarray(want), rtol=1e-4, atol=1e-6)
    assert np.abs(got[3] - got[5]).max() > 0.05 * np.abs(got[5]).max()  # 5 iterations, not 3
    c = experiment.base_config()
    c.optim.update(name="muon", muon_ns_steps=0)
    with pytest.raises(experiment.ConfigError, match=r"optim\.muon_ns_steps=0.*positive integer"):
        experiment.validate(c)
