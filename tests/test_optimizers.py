"""The optimiser and schedule registries: a registered optimiser is built from the config
and trains by its own rule; names not registered are refused naming the field."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attnlab import experiment
from attnlab.optimizers import OPTIMIZERS, SCHEDULES, register_optimizer, register_schedule
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
    [("name", "adamax_typo", "'adamw', 'muon'"), ("schedule", "cosinus", "'constant', 'cosine'")],
)
def test_names_not_registered_are_refused_naming_the_field(field, value, listed):
    cfg = experiment.base_config()
    cfg.optim[field] = value
    with pytest.raises(experiment.ConfigError, match=rf"optim\.{field}.*{listed}"):
        experiment.validate(cfg)
