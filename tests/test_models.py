"""Property tests of the NNX modules and the three architectures."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlab import ModelConfig, build_model
from attnlab.contracts.mixer import MixerCall
from attnlab.nn import Attention, Block

TINY = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, max_len=16)


def tokens(B=2, T=10, V=40, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 3, V)


def decoder_logits(model, t, **kw):
    return model(t, **kw).logits


@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "relative"])
def test_causality_by_gradient(position):
    model = build_model(ModelConfig(**TINY, position=position))
    x_BTD = model.embed(tokens())

    positions = jnp.broadcast_to(jnp.arange(10)[None], (2, 10))

    w_D = jax.random.normal(jax.random.key(9), (32,))

    def outputs_BT(x):  # one scalar per output position (a LayerNorm output sums to 0)
        return jnp.einsum("BTD,D->BT", model.decoder(x, positions_BT=positions)[0], w_D)

    # d out[b, i] / d x[b, j, :] for all i, j at once: [B, T, B, T, D].
    jac = np.asarray(jax.jit(jax.jacrev(outputs_BT))(x_BTD))
    influence_TT = np.abs(jac[0, :, 0]).max(-1)
    assert np.all(np.triu(influence_TT, 1) == 0.0)  # nothing flows from the future
    assert np.all(np.diag(influence_TT) > 0.0)


def test_causality_by_perturbation():
    model = build_model(ModelConfig(**TINY, position="rope", n_kv_heads=2))
    t = tokens()
    base = decoder_logits(model, t)
    for j in (3, 7):
        changed = decoder_logits(model, t.at[:, j].set((t[:, j] + 5) % 40))
        np.testing.assert_array_equal(np.asarray(changed[:, :j]), np.asarray(base[:, :j]))
        assert np.abs(np.asarray(changed[:, j:] - base[:, j:])).max() > 1e-4


def test_causal_false_ablation_sees_the_future():
    model = build_model(ModelConfig(**TINY, causal=False))
    t = tokens()
    changed = decoder_logits(model, t.at[:, 7].set(1))
    assert np.abs(np.asarray(changed[:, :7] - decoder_logits(model, t)[:, :7])).max() > 1e-4


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_padding_invariance_and_no_nan(arch):
    model = build_model(ModelConfig(**TINY, arch=arch))
    graphdef, params = nnx.split(model, nnx.Param)
    valid = jnp.array([[True] * 10, [True] * 6 + [False] * 4, [False] * 10])
    tgt = tokens(B=3, T=5, seed=2)

    @jax.jit
    def run(p, x):
        m = nnx.merge(graphdef, p)
        if arch == "encoder_decoder":
            return m(x, tgt, src_valid_BS=valid).logits
        return m(x, valid_BT=valid).logits

    t = tokens(B=3)
    t2 = jnp.where(valid, t, tokens(B=3, seed=1))  # only padded tokens differ
    a, b = np.asarray(run(params, t)), np.asarray(run(params, t2))
    assert np.isfinite(a).all() and np.isfinite(b).all()
    if arch == "encoder_decoder":  # every decoder position sees only valid source tokens
        np.testing.assert_allclose(a[:2], b[:2], atol=1e-6)
    else:
        for row, n in ((0, 10), (1, 6)):
            np.testing.assert_allclose(a[row, :n], b[row, :n], atol=1e-6)
    # Gradients stay finite with a fully padded row.
    grads = jax.jit(jax.grad(lambda p: run(p, t).sum()))(params)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(grads))


def _self_attention_out(position, perm=None):
    cfg = ModelConfig(**TINY, arch="encoder", position=position, init_std=0.3)
    model = build_model(cfg, seed=3)
    x_BTD = jax.random.normal(jax.random.key(4), (1, 10, 32))
    positions = jnp.arange(10)[None]
    if perm is not None:
        x_BTD = x_BTD[:, perm]
    y, *_ = model.encoder(x_BTD, positions_BT=positions)
    return y


def test_permutation_equivariance_without_positions():
    perm = np.random.default_rng(0).permutation(10)
    y = _self_attention_out("none")
    y_perm = _self_attention_out("none", perm)
    np.testing.assert_allclose(np.asarray(y_perm), np.asarray(y[:, perm]), atol=1e-5)


@pytest.mark.parametrize("position", ["sinusoidal", "rope", "learned"])
def test_positions_break_permutation_equivariance(position):
    perm = np.random.default_rng(0).permutation(10)
    y = _self_attention_out(position)
    y_perm = _self_attention_out(position, perm)
    assert np.abs(np.asarray(y_perm - y[:, perm])).max() > 1e-3


def _attention_pair(K):
    cfg_gqa = ModelConfig(**TINY, n_kv_heads=K, position="rope")
    cfg_mha = ModelConfig(**TINY, position="rope")
    gqa = Attention(cfg_gqa, rngs=nnx.Rngs(0))
    mha = Attention(cfg_mha, rngs=nnx.Rngs(1))
    G = 4 // K
    for name in ("q_DNH", "o_NHD"):
        getattr(mha, name)[...] = getattr(gqa, name)[...]
    for name in ("k_DKH", "v_DKH"):  # each kv head serves G consecutive q heads
        getattr(mha, name)[...] = jnp.repeat(getattr(gqa, name)[...], G, axis=1)
    return gqa, mha


@pytest.mark.parametrize("K", [4, 2, 1])
def test_gqa_equals_mha_with_repeated_kv_weights(K):
    gqa, mha = _attention_pair(K)
    x = jax.random.normal(jax.random.key(0), (2, 9, 32))
    pos = jnp.broadcast_to(jnp.arange(9)[None], (2, 9))
    mask = jnp.tril(jnp.ones((9, 9), bool))[None, None]
    a, _, _ = gqa(x, MixerCall(positions_BT=pos, mask=mask))
    b, _, _ = mha(x, MixerCall(positions_BT=pos, mask=mask))
    k, _ = gqa.project_kv(x, pos)
    assert k.shape == (2, 9, K, 8)  # only K kv heads are ever materialised
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


NORMS, PLACEMENTS = ["layernorm", "rmsnorm"], ["pre", "post"]
FFNS = ["relu", "gelu", "gelu_tanh", "swiglu", "geglu"]
POSITIONS = ["learned", "sinusoidal", "rope", "alibi", "relative", "none"]


def _block(norm, placement, ffn, position):
    cfg = ModelConfig(
        d_model=256,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        norm=norm,
        norm_placement=placement,
        ffn=ffn,
        position=position,
        n_layers=1,
        max_len=16,
    )
    return Block(cfg, rngs=nnx.Rngs(0))


def _block_inputs():
    x = jax.random.normal(jax.random.key(1), (1, 16, 256))
    return x, jnp.arange(16)[None], jnp.tril(jnp.ones((16, 16), bool))[None, None]


@pytest.mark.parametrize("norm,ffn", list(itertools.product(NORMS, FFNS)))
def test_block_shape_for_every_combination(norm, ffn):
    x, pos, mask = _block_inputs()
    for placement, position in itertools.product(PLACEMENTS, POSITIONS):
        graphdef, state = nnx.split(_block(norm, placement, ffn, position))
        # Traced, not compiled: the shape check for all 120 combinations stays cheap.
        y = jax.eval_shape(
            lambda s, g=graphdef: nnx.merge(g, s)(x, MixerCall(positions_BT=pos, mask=mask))[0],
            state,
        )
        assert y.shape == (1, 16, 256) and y.dtype == jnp.float32


# Every value of every factor appears at least once.
JIT_CASES = [
    ("layernorm", "pre", "relu", "learned"),
    ("rmsnorm", "post", "gelu", "sinusoidal"),
    ("layernorm", "post", "gelu_tanh", "rope"),
    ("rmsnorm", "pre", "swiglu", "alibi"),
    ("layernorm", "pre", "geglu", "relative"),
    ("rmsnorm", "post", "swiglu", "none"),
]


@pytest.mark.parametrize("norm,placement,ffn,position", JIT_CASES)
def test_block_jit_equals_no_jit(norm, placement, ffn, position):
    block = _block(norm, placement, ffn, position)
    x, pos, mask = _block_inputs()
    y = block(x, MixerCall(positions_BT=pos, mask=mask))[0]
    graphdef, state = nnx.split(block)
    jitted = jax.jit(
        lambda s, x: nnx.merge(graphdef, s)(x, MixerCall(positions_BT=pos, mask=mask))[0]
    )
    np.testing.assert_allclose(np.asarray(jitted(state, x)), np.asarray(y), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_attention_weights_returned(arch):
    model = build_model(ModelConfig(**TINY, arch=arch, type_vocab_size=2 * (arch == "encoder")))
    t = tokens(T=6)
    out = (
        model(t, t, return_weights=True)
        if arch == "encoder_decoder"
        else model(t, return_weights=True)
    )
    weights = out.weights["decoder"] if arch == "encoder_decoder" else out.weights
    assert len(weights) == 2
    w = np.asarray(weights[0]["self"])
    assert w.shape == (2, 4, 6, 6)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    if arch == "decoder":
        assert np.all(np.triu(w[0, 0], 1) == 0)  # causal: no weight on future keys
        plain = model(t).logits  # weights do not change the logits
        np.testing.assert_allclose(np.asarray(out.logits), np.asarray(plain), atol=1e-5)
    if arch == "encoder_decoder":
        assert weights[0]["cross"].shape == (2, 4, 6, 6)


def test_tied_embeddings_share_the_table_and_untied_do_not():
    tied = build_model(ModelConfig(**TINY))
    untied = build_model(ModelConfig(**TINY, tie_embeddings=False))
    h = jax.random.normal(jax.random.key(0), (1, 3, 32))
    expected = np.asarray(h) @ np.asarray(tied.embed.tokens.embedding_VD[...]).T
    np.testing.assert_allclose(np.asarray(tied.head(h, tied.embed.tokens)), expected, atol=1e-5)
    assert untied.head.head_DV is not None and tied.head.head_DV is None


def test_embedding_scale_multiplies_by_sqrt_d():
    plain = build_model(ModelConfig(**TINY, position="none"), seed=5)
    scaled = build_model(ModelConfig(**TINY, position="none", embed_scale=True), seed=5)
    t = tokens(T=4)
    np.testing.assert_allclose(
        np.asarray(scaled.embed(t)), np.asarray(plain.embed(t)) * 32**0.5, rtol=1e-6
    )


def test_bf16_compute_keeps_float32_params_and_logits():
    model = build_model(ModelConfig(**TINY, dtype="bfloat16"))
    out = model(tokens())
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    assert model.embed.tokens.embedding_VD[...].dtype == jnp.float32
    f32 = build_model(ModelConfig(**TINY))
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(f32(tokens()).logits), atol=5e-2)


def test_same_seed_same_parameters():
    a = nnx.state(build_model(ModelConfig(**TINY), seed=7), nnx.Param)
    b = nnx.state(build_model(ModelConfig(**TINY), seed=7), nnx.Param)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
