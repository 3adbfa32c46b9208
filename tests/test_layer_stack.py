"""Layers as a stack: scanned and unrolled stacks agree; depth does not grow the program.

The scanned stack (``lax.scan`` over parameters stacked on a leading layer axis) is checked
against the same parameters unrolled in a Python loop, and against blocks applied one by
one with masks built independently from ``attnlab.ops``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_count import compiles
from flax import nnx
from tiers import cases

import attnlab
from attnlab import ModelConfig, build_model, init_cache, ops
from attnlab.contracts.mixer import MixerCall
from attnlab.nn.blocks import Block

BASE = dict(vocab_size=40, d_model=32, n_heads=4, n_layers=3, max_len=16, d_ff=48)
# The fast tier keeps one case per architecture; the others compile the same check again.
STACK_SLOW = "one more decoder or encoder-decoder case, scanned and unrolled, with gradients"
CASES = {
    "learned-mha": dict(position="learned"),
    "sinusoidal-gqa-post-remat_full": dict(
        position="sinusoidal", n_kv_heads=2, norm_placement="post", remat="full"
    ),
    "rope-mqa-window-remat_dots": dict(
        position="rope", n_kv_heads=1, sliding_window=3, remat="dots", ffn="swiglu"
    ),
    "alibi-gqa-window_on_layer_1": dict(
        position="alibi", n_kv_heads=2, sliding_window=2, sliding_window_layers=(1,)
    ),
    "encoder-none-dropout-remat_full": dict(
        arch="encoder", position="none", dropout=0.1, attention_dropout=0.1, remat="full"
    ),
    "encoder_decoder-sinusoidal-gqa": dict(
        arch="encoder_decoder", position="sinusoidal", n_kv_heads=2, n_decoder_layers=2
    ),
    "encoder_decoder-relative-qknorm-remat_dots": dict(
        arch="encoder_decoder", position="relative", qk_norm=True, norm="rmsnorm", remat="dots"
    ),
}
B, T = 2, 9


def pair(case):
    """A scanned model and an unrolled model holding the same parameters."""
    cfg = ModelConfig(**BASE, **CASES[case])
    scanned = build_model(cfg, seed=3)
    unrolled = build_model(cfg.replace(scan_layers=False), seed=4)
    nnx.update(unrolled, nnx.state(scanned))
    return cfg, scanned, unrolled


def batch(cfg):
    ids = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    valid = jnp.arange(T)[None, :] < jnp.array([[T], [T - 3]])
    return ids, valid


def loss(model, cfg, ids, valid, key):
    w = jax.random.normal(jax.random.key(7), (cfg.vocab_size,))
    if cfg.arch == "encoder_decoder":
        out = model(ids, ids[:, ::-1], src_valid_BS=valid, key=key)
    elif cfg.arch == "encoder":
        out = model(ids, valid_BT=valid, key=key)
    else:
        out = model(ids, valid_BT=valid, key=key)
    return jnp.einsum("BTV,V->", out.logits, w), out.logits


@pytest.mark.parametrize(
    "case",
    cases(
        list(CASES),
        slow={
            c: STACK_SLOW
            for c in (
                "learned-mha",
                "sinusoidal-gqa-post-remat_full",
                "alibi-gqa-window_on_layer_1",
                "encoder_decoder-sinusoidal-gqa",
            )
        },
    ),
)
def test_scanned_equals_unrolled_logits_and_gradients(case):
    cfg, scanned, unrolled = pair(case)
    ids, valid = batch(cfg)
    key = jax.random.key(5) if cfg.dropout else None

    @jax.jit
    def run(params, graphdef):
        def f(p):
            return loss(nnx.merge(graphdef, p), cfg, ids, valid, key)

        (_, logits), grads = jax.value_and_grad(f, has_aux=True)(params)
        return logits, grads

    results = []
    for model in (scanned, unrolled):
        graphdef, params = nnx.split(model)
        results.append(jax.jit(run, static_argnums=1)(params, graphdef))
    (logits_s, grads_s), (logits_u, grads_u) = results
    np.testing.assert_allclose(logits_s, logits_u, atol=1e-5, rtol=1e-5)
    for gs, gu in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads_u), strict=True):
        np.testing.assert_allclose(gs, gu, atol=1e-5, rtol=1e-4)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads_s))


def cached_logits(model, cfg, ids):
    """Prefill 4 tokens, then one token per step, through the explicit cache."""
    cache = init_cache(cfg, B, cfg.max_len)
    if cfg.arch == "encoder_decoder":
        enc = model.encode(ids)
        cache = model.init_cross_cache(cache, enc)
        call = model.decode
    else:
        call = model
    outs = []
    out = call(ids[:, :4], cache=cache)
    outs.append(out.logits)
    for t in range(4, T):
        out = call(ids[:, t : t + 1], cache=out.cache)
        outs.append(out.logits)
    return jnp.concatenate(outs, axis=1), out.cache


DECODING_FAST = ("rope-mqa-window-remat_dots", "encoder_decoder-relative-qknorm-remat_dots")


@pytest.mark.parametrize(
    "case",
    cases(
        [c for c in CASES if not c.startswith("encoder-")],
        slow={
            c: STACK_SLOW for c in CASES if not c.startswith("encoder-") and c not in DECODING_FAST
        },
    ),
)
def test_scanned_equals_unrolled_cached_decoding_and_the_full_forward(case):
    cfg, scanned, unrolled = pair(case)
    ids, _ = batch(cfg)
    got_s, cache_s = jax.jit(lambda m: cached_logits(m, cfg, ids))(scanned)
    got_u, cache_u = jax.jit(lambda m: cached_logits(m, cfg, ids))(unrolled)
    full = scanned(ids, ids) if cfg.arch == "encoder_decoder" else scanned(ids)
    np.testing.assert_allclose(got_s, got_u, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_s, full.logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(cache_s.k, cache_u.k, atol=1e-6)
    np.testing.assert_array_equal(cache_s.lengths, [T, T])
    assert cache_s.k.shape[0] == cfg.stack_layers  # [L, B, K, S, H]


def test_per_layer_window_equals_blocks_applied_one_by_one():
    """Layer 1 alone slides (window 2); layers 0 and 2 see every earlier key."""
    cfg = ModelConfig(**BASE, **CASES["alibi-gqa-window_on_layer_1"])
    model = build_model(cfg, seed=0)
    ids, _ = batch(cfg)
    stack = model.decoder
    pos = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    graphdef, params = nnx.split(stack.layers)
    bias = ops.alibi_bias(ops.alibi_slopes(cfg.n_heads), pos, pos)
    x = stack.embed_positions(model.embed(ids), pos)
    for i in range(cfg.n_layers):
        block = nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], params))
        assert isinstance(block, Block)
        mask = ops.sliding_window(T, window=2) if i == 1 else ops.causal(T)
        x, *_ = block(x, MixerCall(positions_BT=pos, mask=mask, bias=bias))
    want = model.head(stack.final_norm(x), model.embed.tokens)
    np.testing.assert_allclose(model(ids).logits, want, atol=1e-5, rtol=1e-5)
    every = build_model(cfg.replace(sliding_window_layers=None), seed=0)
    none = build_model(cfg.replace(sliding_window=None, sliding_window_layers=None), seed=0)
    for other in (every, none):
        assert np.abs(np.asarray(other(ids).logits - want)).max() > 1e-4


def hlo_size(n_layers, scan):
    cfg = ModelConfig(**{**BASE, "n_layers": n_layers, "scan_layers": scan})
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def grad(p, ids):
        return jax.grad(lambda p: nnx.merge(graphdef, p)(ids).logits.sum())(p)

    return len(jax.jit(grad).lower(params, ids).as_text())


def test_traced_program_is_flat_in_depth():
    scanned_2, scanned_16 = hlo_size(2, True), hlo_size(16, True)
    assert scanned_16 < 1.05 * scanned_2
    # The unrolled stack grows with depth: the measure above can tell the difference.
    assert hlo_size(16, False) > 4 * hlo_size(2, False)


def test_stacked_parameters_have_a_leading_layer_axis():
    cfg = ModelConfig(**BASE, arch="encoder_decoder", n_decoder_layers=2)
    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))
    assert state["encoder"]["layers"]["attn"]["q_DNH"].shape == (3, 32, 4, 8)
    assert state["decoder"]["layers"]["cross_attn"]["k_DKH"].shape == (2, 32, 4, 8)
    assert state["decoder"]["layers"]["ffn_norm"]["scale_D"].shape == (2, 32)
    assert attnlab.count_params(cfg) == sum(x.size for x in jax.tree.leaves(state))


def test_build_model_initialises_under_one_compile():
    cfg = ModelConfig(**{**BASE, "d_model": 24, "d_ff": 40})
    with compiles() as count:
        build_model(cfg, seed=0)
    assert count() == 1
    with compiles() as count:
        build_model(cfg, seed=1)
    assert count() == 0  # the seed is traced
    a, b = build_model(cfg, seed=0), build_model(cfg, seed=0)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(x, y)
    c = build_model(cfg, seed=1)
    assert (
        np.abs(
            np.asarray(
                nnx.state(c)["embed"]["tokens"]["embedding_VD"][...]
                - nnx.state(a)["embed"]["tokens"]["embedding_VD"][...]
            )
        ).max()
        > 0
    )


@pytest.mark.parametrize(
    "case",
    cases(
        ["rope-mqa-window-remat_dots", "encoder_decoder-sinusoidal-gqa"],
        slow={"encoder_decoder-sinusoidal-gqa": STACK_SLOW},
    ),
)
def test_unstacked_and_scanned_decoding_agree(case):
    """``decode_layers``: the generation loops give the same tokens and logits either way."""
    cfg = ModelConfig(**BASE, **CASES[case])
    ids, _ = batch(cfg)
    results = {}
    for mode in ("unstacked", "scan"):
        model = build_model(cfg.replace(decode_layers=mode), seed=0)
        for beams in (1, 2):
            extra = {"start_id": 1} if cfg.arch == "encoder_decoder" else {}
            results[mode, beams] = attnlab.generate(
                model,
                ids[:, :5],
                max_new_tokens=6,
                return_logits=beams == 1,
                num_beams=beams,
                **extra,
            )
    for beams in (1, 2):
        a, b = results["unstacked", beams], results["scan", beams]
        np.testing.assert_array_equal(a.tokens, b.tokens)
    a, b = results["unstacked", 1], results["scan", 1]
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-5, rtol=1e-5)


def test_unstacked_decoding_slices_no_weights_per_token():
    """The sampling loop's body reads each layer's weights where they lie: the only
    ``dynamic-slice`` left in it is the cache's, never a ``[D, N, H]`` projection."""
    from attnlab.decode import Decoder, SamplingConfig

    cfg = ModelConfig(**{**BASE, "d_model": 48, "n_heads": 3, "head_dim": 16})
    q_shape = "48,3,16"  # q_DNH of one layer

    def loop_hlo(mode):
        model = build_model(cfg.replace(decode_layers=mode), seed=0)
        decoder, params = Decoder.for_model(model)
        cache = init_cache(model.cfg, B, cfg.max_len)
        logits = jnp.zeros((B, cfg.vocab_size))
        args = (params, cache, logits, jax.random.key(0), 4, -1, 0, SamplingConfig())
        lowered = decoder.sample_loop.lower(*args, return_logits=False)
        return lowered.compile().as_text()

    def sliced_weights(text):
        return [
            line
            for line in text.splitlines()
            if "dynamic-slice(" in line and f"[1,{q_shape}]" in line.split("=")[1]
        ]

    assert sliced_weights(loop_hlo("scan"))  # the control: scanning slices every token
    assert not sliced_weights(loop_hlo("unstacked"))
