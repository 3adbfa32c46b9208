"""Memory of a model's gradient with ``attention_impl="chunked"`` is linear in the length.

Compiled only (XLA's memory analysis), never run at these lengths, so it is fast; the dense
``"xla"`` implementation is the control that shows the measure can fail.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from attnlab import ModelConfig, build_model


def temp_bytes(impl, T):
    """Temporaries XLA allocates for the gradient of a 2-layer model at length T."""
    cfg = ModelConfig(
        vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_len=T, position="rope",
        attention_impl=impl,
    )  # fmt: skip
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))

    def grad(p, ids_BT):
        logits = lambda p: nnx.merge(graphdef, p)(ids_BT).logits
        return jax.grad(lambda p: jnp.mean(jax.nn.logsumexp(logits(p), -1)))(p)

    ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
    return jax.jit(grad).lower(params, ids).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow(reason="compiles and measures programs at several sequence lengths")
def test_memory_is_linear_in_the_sequence_length():
    """Compiled only: chunked temporaries double with T (about 150 MiB at T=8192, nearly
    all of it the activations the layers save for the backward pass: remat="full" halves
    it); the dense ones quadruple."""
    at_4k, at_8k = temp_bytes("chunked", 4096), temp_bytes("chunked", 8192)
    assert at_8k < 256 * 2**20, at_8k
    assert at_8k / at_4k < 2.6, (at_4k, at_8k)
    dense_1k, dense_2k = temp_bytes("xla", 1024), temp_bytes("xla", 2048)
    assert dense_2k / dense_1k > 3.3, (dense_1k, dense_2k)  # the measure can tell
