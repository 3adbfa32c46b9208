"""The fused kernels on a mesh (``attnlab.ops.kernel_mesh``): under a mesh the kernel runs
inside ``shard_map``, batch over ``data``/``fsdp`` and heads over ``tensor``, and gives what
one device gives, values and gradients, with a score function reading the global row and
head (ALiBi slopes per head, FoX's ``[B, N, S]`` gate), sinks, grouped heads and ragged rows.

The mesh cases run in a child process on 8 fake CPU devices (they skip in the parent); the
kernels run in interpret mode. ``attnlab lower --mesh`` lowers the same calls for the chips
(a Mosaic TPU kernel cannot be partitioned by the compiler at all).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_flags
from xla_flags import on_mesh

from attnlab.devices import sharding
from attnlab.ops import flex, score_mods
from attnlab.ops.masks import MaskSpec


@pytest.mark.slow(reason="a second pytest process on 8 CPU devices runs every kernel twice")
def test_kernels_on_a_mesh_equal_one_device_in_a_child_on_eight_cpu_devices():
    xla_flags.run_on_devices(__file__, timeout=600)


B, T, N, K, H = 4, 24, 4, 2, 16


def _inputs():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, size=(N,)), jnp.float32)
    gate = jnp.asarray(np.cumsum(rng.uniform(-0.3, 0.0, size=(B, N, T)), -1), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    return q, k, v, slopes, gate, sinks


def _loss(impl, case):
    def loss(q, k, v, slopes, gate, sinks):
        lengths = jnp.array([T, T - 5, 9, 1])  # ragged rows, one of a single key
        mask = MaskSpec.for_sequence(T, causal=True, k_length=lengths)
        extra = {}
        if case == "alibi":
            extra = dict(score_mod=score_mods.alibi(slopes), sinks=sinks)
        elif case == "fox":
            extra = dict(score_mod=score_mods.forget_gate(gate))
        out = flex.flex_attention(q, k, v, mask=mask, implementation=impl, interpret=True,
                                  block_q=8, block_k=8,
                                  **extra)  # fmt: skip
        return (out * jnp.cos(out)).sum(), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))


@on_mesh
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("case", ["alibi", "fox"])
@pytest.mark.parametrize("sizes", [{"data": 2, "fsdp": 2, "tensor": 2}, {"data": 4, "tensor": 2}])
def test_a_kernel_on_a_mesh_gives_what_one_device_gives(impl, case, sizes):
    args = _inputs()
    fn = _loss(impl, case)
    (l1, out1), g1 = fn(*args)
    mesh = sharding.make_mesh(sizes)
    rules = sharding.resolve_rules(None)
    with sharding.activate(mesh, rules), flex.paths.recording() as rec:
        (l8, out8), g8 = _loss(impl, case)(*args)
    if impl == "pallas_tpu" and case == "fox":  # read per row: the chunked path, said once
        (step,) = rec.steps
        assert step.path == "chunked" and "read per row and head" in step.fallbacks[0]
    else:
        assert [s.path for s in rec.steps] == [impl]
    np.testing.assert_allclose(out8, out1, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(l8, l1, rtol=2e-5)
    for a, b in zip(g8, g1, strict=True):
        np.testing.assert_allclose(a, b, rtol=5e-5, atol=5e-5)
