"""Model surgery (``attnlab.nn.surgery``): select layers, replace their mixer, freeze by selection.

Replacing nothing gives back the same logits and parameters bitwise (every leaf copied, none
from the fresh initialisation, which uses another seed); turning 3 of every 4 attention
layers of an 8-layer decoder into Gated DeltaNet keeps every untouched parameter bitwise,
decodes with the cache as the full forward pass does, and trains with the frozen layers
unchanged.
"""

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import optax
import pytest
from flax import nnx

from attnlab import ModelConfig, build_model
from attnlab.errors import ConfigError
from attnlab.nn import surgery

TINY = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, max_len=16, init_std=0.3,
            position="rope", norm="rmsnorm", n_layers=8)  # fmt: skip


def _pure(state):
    return nnx.to_pure_dict(state)


def _logits(cfg, params, ids_BT):
    model = nnx.merge(nnx.graphdef(build_model(cfg, seed=0)), params)
    return np.asarray(model(ids_BT).logits)


IDS = jax.random.randint(jax.random.key(7), (2, 9), 1, 40)


@pytest.mark.parametrize(
    "pattern",
    [
        None,
        pytest.param(
            {"block": ["gated_deltanet", "mha"]},
            marks=pytest.mark.slow(
                reason="the identity again, on a hybrid; the 3-of-4 test keeps one"
            ),
        ),
    ],
)
def test_replacing_nothing_is_the_identity_bitwise(pattern):
    cfg = ModelConfig(**TINY, block_pattern=pattern)
    params = nnx.state(build_model(cfg, seed=1))
    new_cfg, new = surgery.replace_mixer(cfg, params, (), "gated_deltanet", seed=5)
    assert new_cfg == cfg
    a, b = map(jax.tree.leaves, (_pure(params), _pure(new)))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x), strict=True)
    np.testing.assert_array_equal(_logits(new_cfg, new, IDS), _logits(cfg, params, IDS))


def three_of_four():
    cfg = ModelConfig(**TINY)
    params = nnx.state(build_model(cfg, seed=1))
    chosen = surgery.select_layers(cfg, kind="mha", where=lambda i, _k: i % 4 != 3)
    new_cfg, new = surgery.replace_mixer(cfg, params, chosen, "gated_deltanet", seed=3)
    return cfg, params, chosen, new_cfg, new


def test_three_of_every_four_layers_become_gated_deltanet_the_rest_bitwise_kept():
    cfg, params, chosen, new_cfg, new = three_of_four()
    assert chosen == (0, 1, 2, 4, 5, 6)
    assert surgery.layer_kind_names(new_cfg) == ("gated_deltanet",) * 3 + ("mha",) + (
        "gated_deltanet",
    ) * 3 + ("mha",)
    assert len(new_cfg.block_pattern.block) == 4 and not new_cfg.block_pattern.prefix
    old, got = _pure(params)["decoder"], _pure(new)["decoder"]
    blocks = got["layers"]["blocks"]
    for i in range(8):  # layer i: old row i of the homogeneous stack; new block i % 4, row i // 4
        r, p = divmod(i, 4)
        for part in ("attn_norm", "ffn_norm", "ffn") + (("attn",) if i in (3, 7) else ()):
            for x, y in zip(*map(jax.tree.leaves, (old["layers"][part], blocks[p][part])),
                            strict=True):  # fmt: skip
                np.testing.assert_array_equal(np.asarray(y[r]), np.asarray(x[i]), strict=True)
        if i not in (3, 7):
            assert "in_proj_qkvz_DKH" in blocks[p]["attn"]
    np.testing.assert_array_equal(got["final_norm"]["scale_D"], old["final_norm"]["scale_D"])
    np.testing.assert_array_equal(
        _pure(new)["embed"]["tokens"]["embedding_VD"],
        _pure(params)["embed"]["tokens"]["embedding_VD"],
    )
    assert np.isfinite(_logits(new_cfg, new, IDS)).all()


def test_the_surgered_model_decodes_with_the_cache_as_its_full_forward_pass(monkeypatch):
    _, _, _, new_cfg, new = three_of_four()
    # prefill_then_steps builds the model itself: hand it the surgered parameters.
    monkeypatch.setattr(mixer_checks, "build_model", lambda cfg, seed: nnx.merge(
        nnx.graphdef(build_model(cfg, seed=0)), new))  # fmt: skip
    mixer_checks.prefill_then_steps(new_cfg)


@pytest.mark.slow(
    reason="six jitted Adam steps of a surgered model (~6 s); the clipping test above and "
    "tests/test_surgery_run.py keep freezing, through the Trainer, in the fast tier"
)
def test_training_lowers_the_loss_and_leaves_frozen_parameters_unchanged():
    _, _, chosen, new_cfg, params = three_of_four()
    graphdef = nnx.graphdef(build_model(new_cfg, seed=0))
    frozen = surgery.layer_mask(new_cfg, params, [3, 7])  # the kept attention layers
    tx = surgery.freeze(optax.adam(3e-2), frozen)
    ids_BT = jax.random.randint(jax.random.key(1), (4, 12), 1, 40)

    def loss(p):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, p)(ids_BT[:, :-1]).logits)
        return -jnp.mean(jnp.take_along_axis(logp, ids_BT[:, 1:, None], axis=-1))

    @jax.jit
    def step(p, o):
        value, g = jax.value_and_grad(loss)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value

    p, o, losses = params, tx.init(params), []
    for _ in range(6):
        p, o, value = step(p, o)
        losses.append(float(value))
    assert losses[-1] < losses[0] - 0.1, losses
    moved = 0
    for m, a, b in zip(*map(jax.tree.leaves, (frozen, params, p)), strict=True):
        m, a, b = np.asarray(m), np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(b[m], a[m])
        moved += int(np.any(b[~m] != a[~m]))
    assert moved > 10  # the unfrozen parameters did train
    assert sum(int(np.asarray(m).sum()) for m in jax.tree.leaves(frozen)) > 0


def test_frozen_gradients_count_for_nothing_in_the_clipping_norm():
    """Clipped SGD through ``freeze``: the trained entries move by -lr * g * min(1, c / |g_t|)
    with ``|g_t|`` the norm of the trained gradients alone (float64), the frozen ones by 0,
    however large their gradients."""
    rng = np.random.default_rng(0)
    g = {"a": rng.normal(size=(3, 4)), "b": 50.0 * rng.normal(size=(5,))}
    mask = {"a": np.array([[True], [False], [False]]), "b": np.ones((5,), bool)}
    lr, clip = 0.1, 0.5
    tx = surgery.freeze(optax.chain(optax.clip_by_global_norm(clip), optax.sgd(lr)), mask)
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), g)
    grads = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
    got, _ = tx.update(grads, tx.init(params), params)
    trained = np.concatenate([np.broadcast_to(~mask[k], g[k].shape)[...].ravel() * g[k].ravel()
                              for k in g])  # fmt: skip
    scale = min(1.0, clip / np.linalg.norm(trained))
    for k in g:
        want = np.where(mask[k], 0.0, -lr * scale * g[k])
        np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-5, atol=1e-7)
    assert scale < 1.0  # the clipping acted, on the trained gradients' norm


def test_a_mixer_only_mask_leaves_the_layers_norms_and_ffn_out():
    _, _, chosen, new_cfg, params = three_of_four()
    mask = _pure(surgery.layer_mask(new_cfg, params, [1], part="mixer"))
    block = mask["decoder"]["layers"]["blocks"][1]
    assert all(m[0].all() and not m[1].any() for m in jax.tree.leaves(block["attn"]))
    assert not any(m.any() for m in jax.tree.leaves(block["ffn"]))
    assert not any(m.any() for m in jax.tree.leaves(mask["embed"]))


@pytest.mark.slow(reason="builds two more models; the fresh initialisation is the fast tier's")
def test_matching_init_copies_the_mixer_parameters_of_the_same_shape():
    cfg = ModelConfig(**TINY)
    params = nnx.state(build_model(cfg, seed=1))
    _, new = surgery.replace_mixer(cfg, params, [2], "sinks", init="matching", seed=3)
    _, fresh = surgery.replace_mixer(cfg, params, [2], "sinks", seed=3)
    old = _pure(params)["decoder"]["layers"]["attn"]["q_DNH"][2]
    # mha, mha, sinks, then mha x 5: a prefix of the first three, a block of one.
    for state, same in ((new, True), (fresh, False)):
        prefix = _pure(state)["decoder"]["prefix"]["blocks"]
        got = np.asarray(prefix[2]["attn"]["q_DNH"][0])
        assert np.array_equal(got, np.asarray(old)) is same
        assert "sinks_N" in prefix[2]["attn"]


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda cfg, p: surgery.select_layers(cfg, index=8), "index=8"),
        (lambda cfg, p: surgery.select_layers(cfg, kind="mamba9"), "kind='mamba9'"),
        (lambda cfg, p: surgery.replace_mixer(cfg, p, [0], "no_such_mixer"), "mixer="),
        (lambda cfg, p: surgery.replace_mixer(cfg, p, [9], "gated_deltanet"), "layers=9"),
        (lambda cfg, p: surgery.layer_mask(cfg, p, [0], part="ffn"), "part='ffn'"),
    ],
)
def test_bad_selections_are_one_line_errors_naming_the_argument(call, field):
    cfg = ModelConfig(**TINY)
    params = nnx.state(build_model(cfg, seed=1))
    with pytest.raises(ConfigError) as e:
        call(cfg, params)
    assert field in str(e.value) and "\n" not in str(e.value)


def _layer_leaves(stack, path, row):
    return [np.asarray(a[row]) for a in jax.tree.leaves(_get(stack, path))]


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@pytest.mark.slow(
    reason="another layout of the same copying rule, with a prefix and parallel mixers"
)
def test_a_hybrid_with_a_prefix_and_parallel_mixers_keeps_its_other_layers():
    # mla, then [gated_deltanet, mha + mamba2] x 2: the parallel layers become plain mha.
    cfg = ModelConfig(**dict(TINY, n_layers=5), block_pattern={
        "prefix": ["mla"], "block": ["gated_deltanet", {"mixers": ["mha", "mamba2"]}]})  # fmt: skip
    params = nnx.state(build_model(cfg, seed=1))
    chosen = surgery.select_layers(cfg, kind="mha+mamba2")
    assert chosen == (2, 4)
    new_cfg, new = surgery.replace_mixer(cfg, params, chosen, "mha", seed=3)
    assert surgery.layer_kind_names(new_cfg) == ("mla", "gated_deltanet", "mha") * 1 + (
        "gated_deltanet",
        "mha",
    )
    old, got = _pure(params)["decoder"], _pure(new)["decoder"]
    # Untouched: layer 0 (the prefix) and layers 1, 3 (block position 0, rows 0 and 1); the
    # replaced layers' FFN and norms (block position 1).
    pairs = [(("prefix",), 0, ("prefix",), 0)]
    for r in (0, 1):
        pairs.append((("layers", "blocks", 0), r, ("layers", "blocks", 0), r))
        for part in ("ffn", "attn_norm", "ffn_norm"):
            pairs.append((("layers", "blocks", 1, part), r, ("layers", "blocks", 1, part), r))
    for src, r, dst, q in pairs:
        a, b = _layer_leaves(old, src, r), _layer_leaves(got, dst, q)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(y, x, strict=True)
    assert set(got["layers"]["blocks"][1]["attn"]) == {"q_DNH", "k_DKH", "v_DKH", "o_NHD"}
    assert np.isfinite(_logits(new_cfg, new, IDS)).all()


@pytest.mark.slow(reason="builds a mixture-of-experts model with a dense prefix")
def test_a_dense_prefix_of_a_mixture_of_experts_moves_into_the_pattern():
    # DeepSeek's layout: layer 0 a dense FFN (ffn_settings.dense_layers), then MoE layers.
    moe = {"n_experts": 4, "top_k": 2, "d_expert": 8, "dense_layers": 1}
    cfg = ModelConfig(**dict(TINY, n_layers=3), ffn_variant="moe", ffn_settings=moe)
    params = nnx.state(build_model(cfg, seed=1))
    new_cfg, new = surgery.replace_mixer(cfg, params, [2], "mla", seed=3)
    assert new_cfg.ffn_settings.dense_layers == 0
    assert surgery.layer_kind_names(new_cfg) == ("mha", "mha", "mla")
    old, got = _pure(params)["decoder"], _pure(new)["decoder"]
    # old: prefix [1] (dense) + layers [2] (MoE); new: one block of 3 layers, repeated once.
    blocks = got["layers"]["blocks"]
    for src, r, p in ((("prefix",), 0, 0), (("layers",), 0, 1)):
        a, b = _layer_leaves(old, src, r), _layer_leaves(blocks, (p,), 0)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(y, x, strict=True)
    a, b = _layer_leaves(old, ("layers", "ffn"), 1), _layer_leaves(blocks, (2, "ffn"), 0)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(y, x, strict=True)
    assert np.isfinite(_logits(new_cfg, new, IDS)).all()
