"""Expert parallelism: a mixture of experts trained with its experts split over the mesh's
``expert`` axis equals one device.

Like ``test_sharding.py``, the mesh tests run in a child process with 8 fake CPU devices,
started by ``test_expert_mesh_tests_pass_on_eight_cpu_devices``; in the parent they skip.
"""

import pathlib

import jax
import numpy as np
import pytest
import xla_flags
from test_sharding import batches
from xla_flags import on_mesh

from attnlab import experiment
from attnlab.devices import sharding
from attnlab.train import Trainer

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow(reason="a second pytest process on 8 CPU devices compiles the sharded steps")
def test_expert_mesh_tests_pass_on_eight_cpu_devices():
    xla_flags.run_on_devices(__file__)


def tiny_moe():
    cfg = experiment.load_config(str(REPO / "experiments" / "moe_lm.py") + ":tiny")
    cfg.model.update(vocab_size=64, d_model=32, n_heads=4, d_ff=32, n_layers=3, max_len=16)
    cfg.model.ffn_settings.update(n_experts=8, top_k=2, d_expert=16, n_shared=1, dense_layers=1)
    cfg.data.seq_len = 16
    cfg.train.update(batch_size=8, steps=6)
    cfg.optim.warmup_steps = 2
    return cfg


def run(trainer, data):
    state, losses = trainer.init_state(), []
    for b in data:
        state, m = trainer.train_step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


@on_mesh
def test_experts_over_four_devices_train_like_one_device():
    cfg, data = tiny_moe(), batches(6)
    state1, losses1 = run(Trainer(cfg, kind="lm"), data)
    mesh = sharding.make_mesh({"data": 2, "expert": 4})
    state8, losses8 = run(Trainer(cfg, kind="lm", mesh=mesh), data)
    np.testing.assert_allclose(losses8, losses1, rtol=1e-4)
    # The same routing: every expert received the same assignments over the six steps.
    np.testing.assert_array_equal(
        np.asarray(state8["acc"]["metrics"]["moe_router"]["tokens_per_expert"]),
        np.asarray(state1["acc"]["metrics"]["moe_router"]["tokens_per_expert"]),
    )
    w_in = state8["params"]["decoder"]["layers"]["ffn"]["w_in_EDF"]
    assert w_in.sharding.spec[1] == "expert"  # [layers, experts, D, F]
    assert w_in.addressable_shards[0].data.shape[1] == 8 // 4
    got = jax.tree.leaves(jax.device_get(state8["params"]))
    want = jax.tree.leaves(jax.device_get(state1["params"]))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
