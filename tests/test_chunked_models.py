"""Models with ``attention_impl="chunked"``: the same logits and gradients as the reference
implementation (masks and position biases passed as descriptions), and cached decoding equal
to the full forward pass. (Memory: ``test_chunked_memory.py``.)

Blocks are tiny (4 x 8) so that 13 tokens span several blocks, with padding. Two models
cover the stacks: a decoder (ALiBi, GQA, a window on layer 1 only: per-layer data in the
scan, packed segments) and an encoder-decoder (T5 relative positions, MQA, QK-norm, source
padding: a bidirectional encoder with padding, a causal decoder with a window on layer 1,
cross-attention).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import ModelConfig, build_model, init_cache

BASE = dict(vocab_size=40, d_model=32, n_heads=4, n_layers=2, max_len=16, d_ff=48)
BLOCKS = dict(attention_block_q=4, attention_block_k=8)
CASES = {
    "decoder-alibi-gqa-window_on_layer_1-segments": dict(
        position="alibi", n_kv_heads=2, sliding_window=3, sliding_window_layers=(1,)
    ),
    "encoder_decoder-relative-mqa-padding-window_on_layer_1": dict(
        arch="encoder_decoder",
        position="relative",
        n_kv_heads=1,
        qk_norm=True,
        sliding_window=4,  # the causal decoder's layer 1
        sliding_window_layers=(1,),
    ),
}
# The fast tier runs the decoder; the encoder-decoder's programs (two stacks and
# cross-attention, with gradients) are the slowest to compile.
CASE_PARAMS = [
    pytest.param(case, marks=pytest.mark.slow(reason="the encoder-decoder: slowest to compile"))
    if case.startswith("encoder_decoder")
    else case
    for case in CASES
]
B, T = 2, 13
SEGMENTS_BT = jnp.array([[1] * 5 + [2] * 8, [1] * 9 + [0] * 4])
VALID_BT = jnp.arange(T)[None, :] < jnp.array([[T], [9]])


def models(case):
    """The case's model with the reference implementation and with chunked: same weights."""
    cfg = ModelConfig(**BASE, **CASES[case], attention_impl="reference")
    chunked = cfg.replace(attention_impl="chunked", **BLOCKS)
    return cfg, build_model(cfg, seed=1), build_model(chunked, seed=1)


def forward(model, cfg, ids):
    if cfg.arch == "encoder_decoder":
        return model(ids, ids[:, ::-1], src_valid_BS=VALID_BT).logits
    return model(ids, segment_ids_BT=SEGMENTS_BT).logits


@pytest.mark.slow(reason="model gradients through the blocks; test_ops_chunked checks the op's")
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_chunked_model_equals_reference_logits_and_gradients(case):
    cfg, reference, chunked = models(case)
    ids = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
    w_V = jax.random.normal(jax.random.key(3), (cfg.vocab_size,))

    @jax.jit
    def both(ref_params, chunked_params):
        def run(graphdef, params):
            def loss(p):
                logits = forward(nnx.merge(graphdef, p), cfg, ids)
                return jnp.einsum("BTV,V->", logits, w_V), logits

            return jax.value_and_grad(loss, has_aux=True)(params)

        return run(ref_graph, ref_params), run(chunked_graph, chunked_params)

    ref_graph, ref_params = nnx.split(reference)
    chunked_graph, chunked_params = nnx.split(chunked)
    ((_, want), want_grads), ((_, got), got_grads) = both(ref_params, chunked_params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    flat_want = jax.tree.leaves_with_path(want_grads)
    for (path, g), h in zip(flat_want, jax.tree.leaves(got_grads), strict=True):
        np.testing.assert_allclose(
            np.asarray(h), np.asarray(g), rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )
    if cfg.position == "relative":  # the tables' gradients came through the blocks
        for stack in ("encoder", "decoder"):
            table = got_grads[stack]["relative"]["table_XN"][...]
            assert np.abs(np.asarray(table)).max() > 0


def cached_logits(model, cfg, ids):
    """Prefill 6 tokens, one single-token step, then the last 6 tokens in one call."""
    cache = init_cache(cfg, B, cfg.max_len)
    call = model
    if cfg.arch == "encoder_decoder":
        cache = model.init_cross_cache(cache, model.encode(ids, src_valid_BS=VALID_BT), VALID_BT)
        call = model.decode
    outs = []
    for start, stop in ((0, 6), (6, 7), (7, T)):
        out = call(ids[:, start:stop], cache=cache)
        outs.append(out.logits)
        cache = out.cache
    return jnp.concatenate(outs, axis=1)


@pytest.mark.slow(
    reason="compiles a chunked prefill and decode step; the decoder case covers chunking"
)
def test_chunked_cached_decoding_equals_the_full_forward():
    """Prefill, single steps and a multi-token step after a cache: per-row offsets, written
    lengths, the decoder's per-layer window, relative positions and cross-attention."""
    cfg, _, chunked = models("encoder_decoder-relative-mqa-padding-window_on_layer_1")
    ids = jax.random.randint(jax.random.key(4), (B, T), 0, cfg.vocab_size)

    @jax.jit
    def cached_and_full(model):
        if cfg.arch == "encoder_decoder":
            full = model(ids, ids, src_valid_BS=VALID_BT).logits
        else:
            full = model(ids).logits
        return cached_logits(model, model.cfg, ids), full

    got, full = cached_and_full(chunked)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-5, atol=1e-5)


@pytest.fixture
def chunked_calls(monkeypatch):
    """The block sizes of every call of the chunked path, spied on."""
    from attnlab.ops import attention as attention_ops

    calls, real = [], attention_ops.chunked_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("block_q"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_ops, "chunked_attention", spy)
    return calls


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_auto_runs_blockwise_on_cpu_from_its_threshold_with_the_reference_logits(
    case, chunked_calls, monkeypatch
):
    from attnlab.ops import attention as attention_ops

    assert jax.default_backend() == "cpu"
    cfg = ModelConfig(**BASE, **CASES[case], attention_impl="reference")
    auto = cfg.replace(attention_impl="auto")
    ids = jax.random.randint(jax.random.key(2), (B, T), 0, cfg.vocab_size)
    want = forward(build_model(cfg, seed=1), cfg, ids)
    for threshold, blockwise in ((T, True), (T + 1, False)):
        chunked_calls.clear()
        monkeypatch.setattr(attention_ops, "AUTO_CHUNKED_MIN_T", threshold)
        got = forward(build_model(auto, seed=1), auto, ids)
        assert bool(chunked_calls) == blockwise
        assert set(chunked_calls) <= {attention_ops.AUTO_BLOCK}
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow(reason="compiles the dense path with weights and dropout again")
def test_auto_keeps_the_dense_path_for_weights_and_dropout(chunked_calls):
    from attnlab.ops import attention as attention_ops

    q, k, v = (jax.random.normal(jax.random.key(i), (1, 128, 2, 8)) for i in range(3))
    mask = jnp.tril(jnp.ones((128, 128), bool))[None, None]
    want = attention_ops.dot_product_attention(q, k, v, mask=mask, implementation="reference")
    got = attention_ops.dot_product_attention(q, k, v, mask=mask, implementation="auto")
    assert chunked_calls == [attention_ops.AUTO_BLOCK]  # 128 queries on CPU: blockwise
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    chunked_calls.clear()
    attention_ops.dot_product_attention(
        q, k, v, mask=mask, implementation="auto", return_weights=True
    )
    attention_ops.dot_product_attention(
        q, k, v, mask=mask, implementation="auto", dropout_rate=0.1, dropout_key=jax.random.key(0)
    )
    assert chunked_calls == []
