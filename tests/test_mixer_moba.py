"""Mixture of Block Attention (``mixer="moba"``) against its float64 formula written from the
paper (block means, the gate's top-k, the union with the query's own block), the selection
as a no-op (dense causal attention) and as real sparsity, cached decoding of ragged prompts
(a prefill split anywhere, then token by token) like one forward pass, finite gradients
with masked rows, its cache and its settings' errors."""

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import reference as ref
from flax import nnx

from attnlab import ModelConfig, ops
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.ops import sparse_blocks

B, T = 2, 11
TINY = dict(mixer_checks.TINY, n_kv_heads=2, position="none", mixer="moba")
SPARSE = {"block_size": 3, "topk": 1}


def moba_float64(q_BTNH, k_BSKH, v_BSKH, *, block, topk):
    """MoBA (Lu et al. 2025, eqs. 2-6), one query at a time: past block ``j`` (its keys
    ``[j block, (j+1) block)`` all before the query's block) scores ``q . mean(K_j)``; the
    query attends the keys of its ``topk`` best past blocks and of its own block, causally."""
    q, k, v = (np.asarray(a, np.float64) for a in (q_BTNH, k_BSKH, v_BSKH))
    Bn, Tn, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for b in range(Bn):
        for n in range(N):
            kk, vv = k[b, :, n // (N // K)], v[b, :, n // (N // K)]
            for t in range(Tn):
                own = t // block
                scores = [q[b, t, n] @ kk[j * block : (j + 1) * block].mean(0) for j in range(own)]
                best = sorted(range(own), key=lambda j: -scores[j])[:topk]
                keys = [s for s in range(min(S, t + 1)) if s // block in best or s // block == own]
                logits = np.array([q[b, t, n] @ kk[s] for s in keys]) / np.sqrt(H)
                p = np.exp(logits - logits.max())
                out[b, t, n] = (p / p.sum()) @ vv[keys]
    return out


def _layer(**settings):
    cfg = ModelConfig(**TINY, mixer_settings={**SPARSE, **settings})
    layer = get_mixer("moba")(cfg, cfg.mixer_settings, rngs=nnx.Rngs(0))
    x_BTD = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, cfg.d_model)), jnp.float32)
    return cfg, layer, x_BTD


def test_moba_layer_equals_its_float64_formula():
    """Blocks of 3 over T = 11 (four blocks, the last partial), one past block per query,
    grouped heads; projections and the output projection in float64 too."""
    _, layer, x_BTD = _layer()
    call = MixerCall(
        positions_BT=jnp.broadcast_to(jnp.arange(T), (B, T)),
        mask=ops.MaskSpec.for_sequence(T, causal=True),
    )
    got = jax.jit(lambda x: layer(x, call)[0])(x_BTD)
    p = {n: np.asarray(getattr(layer, n)[...], np.float64)
         for n in ("q_DNH", "k_DKH", "v_DKH", "o_NHD")}  # fmt: skip
    x = np.asarray(x_BTD, np.float64)
    q, k, v = (np.einsum("BTD,DNH->BTNH", x, p[n]) for n in ("q_DNH", "k_DKH", "v_DKH"))
    want = np.einsum("BTNH,NHD->BTD", moba_float64(q, k, v, block=3, topk=1), p["o_NHD"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _qkv(seed=0, N=4, K=2, H=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H))
    k, v = rng.standard_normal((2, B, T, K, H))
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v))


@pytest.mark.slow(reason="compiles the attention under two selections and dense attention")
def test_choosing_every_block_is_dense_causal_attention_and_fewer_differ():
    """With ``topk`` covering every past block the mask is the causal one
    (``jax.nn.dot_product_attention``); with one past block a query skips keys."""
    q, k, v = _qkv()
    spec = ops.MaskSpec.for_sequence(T, causal=True)

    @jax.jit
    def outputs(q, k, v):
        outs = []
        for topk in (1, sparse_blocks.n_blocks(T, 3) - 1):
            chosen = sparse_blocks.moba_selection(q, k, spec.q_pos, block=3, topk=topk)
            mask = sparse_blocks.blocks_to_keys(chosen, 3, T) & spec.dense()
            outs.append(ops.flex_attention(q, k, v, mask=mask, implementation="reference"))
        return *outs, jax.nn.dot_product_attention(q, k, v, is_causal=True)

    sparse, every, dense = outputs(q, k, v)
    np.testing.assert_allclose(every, dense, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(sparse - dense).max()) > 1e-2  # a query skipped a past block


def test_the_own_block_is_always_chosen_and_future_blocks_never():
    q, k, _ = _qkv(1)
    q_pos = jnp.arange(T)[None]
    select = jax.jit(lambda q, k: sparse_blocks.moba_selection(q, k, q_pos, block=3, topk=1))
    chosen = np.asarray(select(q, k))
    own = np.arange(T) // 3
    J = chosen.shape[-1]
    assert chosen[..., np.arange(T), own].all()
    assert not (chosen & (np.arange(J)[None, :] > own[:, None])).any()
    assert (chosen.sum(-1) == np.minimum(own, 1) + 1).all()  # one past block, once there is one


def test_moba_keeps_mha_keys_and_values_in_the_cache():
    cfg = ModelConfig(**TINY)
    entries = get_mixer("moba").cache_entries(cfg, cfg.mixer_settings)
    assert set(entries) == {"keys", "values"}
    assert entries["keys"].shape == (cfg.n_kv_heads, -1, cfg.head_dim)


@pytest.mark.slow(reason="compiles a decoder's prefills, decode steps and forward pass")
def test_moba_decodes_ragged_prompts_like_its_forward_pass():
    """Ragged prefills then token by token; a prefill split into chunks of 3 (a chunk
    starting inside a block) equals one forward pass."""
    cfg = ModelConfig(**{**TINY, "position": "rope"}, mixer_settings=SPARSE)
    mixer_checks.prefill_then_steps(cfg, atol=2e-5)
    mixer_checks.split_prefill_equals_forward(cfg, chunk=3)


@pytest.mark.slow(reason="compiles a decoder's backward pass")
def test_moba_gradients_are_finite_with_masked_rows():
    mixer_checks.grads_finite_with_masked_rows(ModelConfig(**TINY, mixer_settings=SPARSE))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"mixer_settings": {"block_size": 0}}, ["mixer_settings.block_size=0", "positive"]),
        ({"mixer_settings": {"topk": 0}}, ["mixer_settings.topk=0", "positive integer"]),
        ({"mixer_settings": {"topk": 1.5}}, ["mixer_settings.topk=1.5"]),
        ({"causal": False}, ["causal=False", "mixer='moba'", "set causal=True"]),
        ({"sliding_window": 4}, ["sliding_window", "mixer='moba'", "sliding_window=None"]),
        ({"position": "alibi"}, ["position='alibi'", "mixer='moba'", "'rope'"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(changes, words):
    mixer_checks.one_line_config_error(words, **{**TINY, **changes})


def test_the_reference_is_softmax_attention_when_every_block_is_chosen():
    """The float64 formula itself: with every past block chosen it is causal attention."""
    q, k, v = (np.asarray(a, np.float64) for a in _qkv(2))
    want, _ = ref.attention(q, k, v, mask=np.tril(np.ones((T, T), bool))[None, None])
    np.testing.assert_allclose(moba_float64(q, k, v, block=3, topk=3), want, atol=1e-12)
