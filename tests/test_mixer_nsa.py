"""Native Sparse Attention (``mixer="nsa"``) against its float64 formula written from the
paper (compression MLP, compressed attention, block importance summed over a group, top-n
with the first and local blocks, sliding window, sigmoid gates), the selection as a no-op
(dense causal attention) and as real sparsity, cached decoding of ragged prompts (a prefill
split anywhere, then token by token) like one forward pass, finite gradients with masked
rows, its cache and its settings' errors."""

import jax
import jax.numpy as jnp
import mixer_checks
import numpy as np
import pytest
import reference as ref
from flax import nnx

from attnlab import ModelConfig, ops
from attnlab.contracts.mixer import MixerCall, get_mixer
from attnlab.errors import ConfigError
from attnlab.ops import sparse_blocks
from attnlab.ops.block_mask import EMPTY, BlockMask

B, T = 2, 16
TINY = dict(mixer_checks.TINY, n_kv_heads=2, position="none", mixer="nsa")
# l = 4 every d = 2 (seven compression blocks), l' = 2 (eight selection blocks), the first,
# the own and one more block per query, a window of 3.
SMALL = dict(compress_block=4, compress_stride=2, select_block=2, top_n=3, local_blocks=1, window=3)


def _softmax_attend(q, k, v, keys, scale):
    if not keys:
        return np.zeros_like(q)
    logits = np.array([q @ k[s] for s in keys]) * scale
    p = np.exp(logits - logits.max())
    return (p / p.sum()) @ v[keys]


def nsa_float64(layer, x_BTD, s):
    """NSA (Yuan et al. 2025, eqs. 5-12) one query at a time, from the layer's parameters.

    Compression block i holds keys ``[i d, i d + l)`` (eq. 7) and is attended once complete;
    its key is ``MLP(vec(K_block + pos))``. Selection block j holds keys ``[j l', (j+1) l')``;
    its importance is the summed compressed probability of the compression blocks sharing a
    key with it (eq. 9), summed over the group's heads (eq. 10); the query keeps block 0 and
    its ``local_blocks`` latest, then the most important others up to ``top_n`` (eq. 11;
    ties to the lower index). Branches are mixed by ``sigmoid(x W_g + b_g)`` (eq. 5)."""
    f = lambda name: np.asarray(getattr(layer, name)[...], np.float64)
    x = np.asarray(x_BTD, np.float64)
    proj = lambda name: np.einsum("BTD,D...->BT...", x, f(name))
    q = proj("q_DNH")
    ks, vs, kc, vc, kw, vw = (
        proj(f"{p}_DKH") for p in ("k", "v", "cmp_k", "cmp_v", "win_k", "win_v")
    )
    g = 1 / (1 + np.exp(-(np.einsum("BTD,DNZ->BTNZ", x, f("gate_DNZ")) + f("gate_bias_NZ"))))
    Bn, Tn, N, H = q.shape
    K = ks.shape[2]
    G = N // K
    scale = H**-0.5
    ln, d, lp = s["compress_block"], s["compress_stride"], s["select_block"]
    C = (Tn - ln) // d + 1
    silu = lambda z: z / (1 + np.exp(-z))

    def phi(x_SKH, kv):
        out = np.zeros((C, K, H))
        for i in range(C):
            blk = x_SKH[i * d : i * d + ln] + f(f"cmp_{kv}_pos_PH")[:, None, :]  # [P, K, H]
            hid = np.einsum("PKH,PHZ->KZ", blk, f(f"cmp_{kv}_in_PHZ")) + f(f"cmp_{kv}_in_bias_Z")
            out[i] = silu(hid) @ f(f"cmp_{kv}_out_ZH")
        return out

    out = np.zeros((Bn, Tn, N, H))
    for b in range(Bn):
        kcc, vcc = phi(kc[b], "k"), phi(vc[b], "v")
        for t in range(Tn):
            blocks = [i for i in range(C) if i * d + ln - 1 <= t]
            o_cmp = np.zeros((N, H))
            p_cmp = np.zeros((N, C))
            for n in range(N):
                if blocks:
                    logits = np.array([q[b, t, n] @ kcc[i, n // G] for i in blocks]) * scale
                    w = np.exp(logits - logits.max())
                    p_cmp[n, blocks] = w / w.sum()
                    o_cmp[n] = p_cmp[n] @ vcc[:, n // G]
            own = t // lp
            for kv_head in range(K):
                heads = range(kv_head * G, (kv_head + 1) * G)
                importance = [
                    sum(p_cmp[n, i] for n in heads for i in range(C)
                        if i * d < (j + 1) * lp and i * d + ln > j * lp)
                    for j in range(own + 1)
                ]  # fmt: skip
                forced = {0} | {j for j in range(own + 1) if j > own - s["local_blocks"]}
                rest = sorted(set(range(own + 1)) - forced, key=lambda j: (-importance[j], j))
                chosen = forced | set(rest[: max(0, s["top_n"] - len(forced))])
                keys = [u for u in range(t + 1) if u // lp in chosen]
                window = [u for u in range(t + 1) if u > t - s["window"]]
                for n in heads:
                    o_slc = _softmax_attend(
                        q[b, t, n], ks[b, :, kv_head], vs[b, :, kv_head], keys, scale
                    )
                    o_win = _softmax_attend(
                        q[b, t, n], kw[b, :, kv_head], vw[b, :, kv_head], window, scale
                    )
                    gc, gs, gw = g[b, t, n]
                    out[b, t, n] = gc * o_cmp[n] + gs * o_slc + gw * o_win
    return np.einsum("BTNH,NHD->BTD", out, f("o_NHD"))


def _layer(**settings):
    cfg = ModelConfig(**TINY, mixer_settings={**SMALL, **settings})
    layer = get_mixer("nsa")(cfg, cfg.mixer_settings, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    layer.gate_bias_NZ[...] = jnp.asarray(rng.normal(size=layer.gate_bias_NZ.shape), jnp.float32)
    x_BTD = jnp.asarray(rng.standard_normal((B, T, cfg.d_model)), jnp.float32)
    return cfg, layer, x_BTD


def test_nsa_layer_equals_its_float64_formula():
    cfg, layer, x_BTD = _layer()
    call = MixerCall(
        positions_BT=jnp.broadcast_to(jnp.arange(T), (B, T)),
        mask=ops.MaskSpec.for_sequence(T, causal=True),
    )
    got = jax.jit(lambda x: layer(x, call)[0])(x_BTD)
    want = nsa_float64(layer, x_BTD, cfg.mixer_settings.to_dict())
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow(reason="compiles the attention under two selections and dense attention")
def test_choosing_every_block_is_dense_causal_attention_and_fewer_differ():
    """The selected branch alone: with ``top_n`` covering every block its mask is the causal
    one (``jax.nn.dot_product_attention``); with two blocks a query skips keys."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, 4, 8)), jnp.float32)
    k, v = jnp.asarray(rng.standard_normal((2, B, T, 2, 8)), jnp.float32)
    probs_BNTC = jnp.asarray(rng.dirichlet(np.ones(7), size=(B, 4, T)), jnp.float32)
    spec = ops.MaskSpec.for_sequence(T, causal=True)

    @jax.jit
    def outputs(probs_BNTC):
        outs = []
        for top_n in (2, 8):
            chosen = sparse_blocks.nsa_selection(
                probs_BNTC, spec.q_pos, S=T, n_kv_heads=2, length=4, stride=2, block=2,
                top_n=top_n, local_blocks=1,
            )  # fmt: skip
            mask = sparse_blocks.blocks_to_keys(chosen, 2, T) & spec.dense()
            outs.append(ops.flex_attention(q, k, v, mask=mask, implementation="reference"))
        return *outs, jax.nn.dot_product_attention(q, k, v, is_causal=True)

    sparse, every, dense = outputs(probs_BNTC)
    np.testing.assert_allclose(every, dense, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(sparse - dense).max()) > 1e-2


def test_a_group_shares_its_blocks_and_keeps_the_first_and_local_ones():
    rng = np.random.default_rng(3)
    probs_BNTC = jnp.asarray(rng.dirichlet(np.ones(7), size=(B, 4, T)), jnp.float32)
    select = jax.jit(lambda p: sparse_blocks.nsa_selection(
        p, jnp.arange(T)[None], S=T, n_kv_heads=2, length=4, stride=2, block=2, top_n=3,
        local_blocks=1,
    ))  # fmt: skip
    chosen = np.asarray(select(probs_BNTC))
    np.testing.assert_array_equal(chosen[:, 0], chosen[:, 1])  # heads 0, 1: kv-head 0
    own = np.arange(T) // 2
    assert chosen[..., 0].all() and chosen[..., np.arange(T), own].all()
    assert (chosen.sum(-1) == np.minimum(own + 1, 3)).all()
    assert not (chosen & (np.arange(8)[None, :] > own[:, None])).any()
    # Per query (query blocks of 1), the unchosen key blocks are EMPTY: skipped.
    mask = np.asarray(sparse_blocks.blocks_to_keys(chosen, 2, T)) & np.tri(T, dtype=bool)
    kinds = jax.jit(lambda m: BlockMask.from_dense(m, block_q=1, block_k=2).kind_QK)
    kinds_QK = np.asarray(kinds(mask[:1, :1]))
    np.testing.assert_array_equal(kinds_QK == EMPTY, ~chosen[0, 0])


def test_nsa_caches_each_branch_keys_and_values():
    cfg = ModelConfig(**TINY)
    entries = get_mixer("nsa").cache_entries(cfg, cfg.mixer_settings)
    roles = {"keys", "values", "cmp_keys", "cmp_values", "window_keys", "window_values"}
    assert set(entries) == roles
    assert all(e.shape == (cfg.n_kv_heads, -1, cfg.head_dim) for e in entries.values())


@pytest.mark.slow(reason="compiles a decoder's prefills, decode steps and forward pass")
def test_nsa_decodes_ragged_prompts_like_its_forward_pass():
    """Ragged prefills then token by token; a prefill split into chunks of 3 (inside the
    compression and selection blocks) equals one forward pass."""
    cfg = ModelConfig(**{**TINY, "position": "rope"}, mixer_settings=SMALL)
    mixer_checks.prefill_then_steps(cfg, atol=2e-5)
    mixer_checks.split_prefill_equals_forward(cfg, chunk=3)


@pytest.mark.slow(reason="compiles a decoder's backward pass")
def test_nsa_gradients_are_finite_with_masked_rows():
    mixer_checks.grads_finite_with_masked_rows(ModelConfig(**TINY, mixer_settings=SMALL))


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"compress_stride": 0}, ["mixer_settings.compress_stride=0", "positive integer"]),
        ({"compress_block": 4, "compress_stride": 8}, ["compress_block=4", "compress_stride=8"]),
        ({"compress_block": 6, "compress_stride": 4}, ["compress_block=6", "multiple"]),
        ({"select_block": 6, "compress_stride": 4, "compress_block": 8}, ["select_block=6"]),
        ({"top_n": 0}, ["mixer_settings.top_n=0", "positive integer"]),
        ({"top_n": 2, "local_blocks": 2}, ["mixer_settings.top_n=2", "local_blocks=2"]),
        ({"local_blocks": -1}, ["mixer_settings.local_blocks=-1", "non-negative"]),
        ({"window": 0}, ["mixer_settings.window=0", "positive integer"]),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(settings, words):
    mixer_checks.one_line_config_error(words, **TINY, mixer_settings=settings)
    with pytest.raises(ConfigError, match="causal=False is invalid with mixer='nsa'"):
        ModelConfig(**TINY, causal=False)


def test_the_reference_branches_are_softmax_attention():
    """The float64 helper the formula is built on is softmax attention (``reference``)."""
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 1, 5, 1, 8))
    want, _ = ref.attention(q, k, v, mask=np.array([True, False, True, True, False])[None])
    got = _softmax_attend(q[0, 0, 0], k[0, :, 0], v[0, :, 0], [0, 2, 3], 8**-0.5)
    np.testing.assert_allclose(got, want[0, 0, 0], atol=1e-12)
