"""Score functions may close over arrays of any dtype: a float slope (which takes a gradient),
an integer per-call offset and a boolean per-head flag (which take none), traced inside a
``lax.scan`` over layers and under ``jit(grad)``.

Values and gradients are checked against float64 NumPy (``tests/flex_reference.py``) on the
chunked path and the Pallas kernels in interpret mode, and through a model's scanned and
unstacked layer stacks against the dense reference path (plain autodiff, no custom VJP);
ring attention's position bias, hoisted the same way, against ``jax.nn``'s attention. A
function that cannot be a score function still fails in one line naming ``score_mod``.
"""

import dataclasses

import flex_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlab
from attnlab import ModelConfig, build_model
from attnlab.nn.mixers.mha import Attention
from attnlab.ops import flex, score_mods
from attnlab.ops.flex import flex_attention
from attnlab.ops.masks import MaskSpec

F32 = jnp.float32
B, T, N, K, H, L = 2, 16, 4, 2, 8, 2  # L layers in the scan
BLOCK = 8  # two query and two key blocks


def offset_mod(slope_N, off_B, flag_N):
    """``s + 0.1 slope[h] sign[h] (kv - q - off[b])``, ``sign`` 1 where the head's flag is set
    and -0.5 elsewhere: closes over a float, an integer and a boolean array."""

    def mod(s, b, h, q_idx, kv_idx):
        sign = jnp.where(flag_N[h], 1.0, -0.5)
        return s + 0.1 * slope_N[h] * sign * (kv_idx - q_idx - off_B[b]).astype(F32)

    return mod


def _inputs(seed=0):
    r = np.random.default_rng(seed)
    q = r.normal(size=(B, T, N, H))
    k, v = r.normal(size=(B, T, K, H)), r.normal(size=(B, T, K, H))
    do_L = r.normal(size=(L, B, T, N, H))
    slopes_LN = r.normal(size=(L, N))
    offs_LB = r.integers(-3, 4, size=(L, B)).astype(np.int32)
    flags_LN = r.random((L, N)) < 0.5
    return q, k, v, do_L, slopes_LN, offs_LB, flags_LN


def float64_reference(q, k, v, do_L, slopes_LN, offs_LB, flags_LN, causal=True):
    """Per layer, NumPy float64: the outputs, and the gradients of ``sum_l <out_l, do_l>``."""
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    outs, dq, dk, dv, dslopes = [], 0.0, 0.0, 0.0, []
    for slope_N, off_B, flag_N, do in zip(slopes_LN, offs_LB, flags_LN, do_L, strict=True):
        rel_BNTS = (
            0.1
            * np.where(flag_N, 1.0, -0.5)[None, :, None, None]
            * (s - t - off_B[:, None, None, None])
        )
        mod = lambda s1, rel=rel_BNTS, slope=slope_N: (s1 + slope[None, :, None, None] * rel, 1.0)
        r = ref.flex(q, k, v, do, mask=ref.causal(B, T, T) if causal else None, mod=mod)
        outs.append(r["out"])
        dq, dk, dv = dq + r["dq"], dk + r["dk"], dv + r["dv"]
        dslopes.append((r["ds2"] * rel_BNTS).sum((0, 2, 3)))
    return np.stack(outs), dq, dk, dv, np.stack(dslopes)


def scanned_flex(implementation, causal=True):
    """``jit(grad)`` of ``sum_l <out_l, do_l>`` over a ``lax.scan`` of L layers, each with its
    own slope, offset and flag (traced as the scan's inputs): ``(outs, grads)``."""

    def loss(q, k, v, slopes_LN, offs_LB, flags_LN, do_L):
        mask = MaskSpec.for_sequence(T, causal=True) if causal else None

        def layer(total, xs):
            slope_N, off_B, flag_N, do = xs
            out = flex_attention(
                q, k, v, score_mod=offset_mod(slope_N, off_B, flag_N), mask=mask,
                implementation=implementation, interpret=True, block_q=BLOCK, block_k=BLOCK,
            )  # fmt: skip
            return total + jnp.sum(out * do), out

        return jax.lax.scan(layer, jnp.float32(0), (slopes_LN, offs_LB, flags_LN, do_L))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True, allow_int=True)
    return jax.jit(lambda *a: grad(*a)[::-1])


KERNEL_SLOW = pytest.mark.slow(reason="interpret-mode Pallas forward and backward, 2 layers")


@pytest.mark.parametrize(
    "implementation, causal",
    [
        ("chunked", True),
        ("chunked", False),
        pytest.param("pallas_gpu", True, marks=KERNEL_SLOW),
        pytest.param("pallas_tpu", False, marks=KERNEL_SLOW),
        pytest.param("pallas_tpu", True, marks=KERNEL_SLOW),
    ],
)
def test_integer_and_boolean_closures_in_a_layer_scan_match_float64(
    implementation, causal, monkeypatch
):
    fallbacks = []
    monkeypatch.setattr(flex, "say", fallbacks.append)  # a kernel must not hand the call on
    q, k, v, do_L, slopes_LN, offs_LB, flags_LN = _inputs()
    args = [jnp.asarray(x, F32) for x in (q, k, v, do_L, slopes_LN)]
    q32, k32, v32, do32, slopes32 = args
    outs, grads = scanned_flex(implementation, causal)(
        q32, k32, v32, slopes32, jnp.asarray(offs_LB), jnp.asarray(flags_LN), do32
    )
    assert fallbacks == []
    want_outs, dq, dk, dv, dslopes = float64_reference(*_inputs(), causal=causal)
    tol = dict(atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(outs, want_outs, **tol)
    for got, want in zip(grads[:4], (dq, dk, dv, dslopes), strict=True):
        np.testing.assert_allclose(got, want, **tol)
    # The integer and boolean arrays take no gradient.
    assert grads[4].dtype == jax.dtypes.float0 and grads[4].shape == (L, B)
    assert grads[5].dtype == jax.dtypes.float0 and grads[5].shape == (L, N)


def test_the_one_query_path_and_a_bad_function_in_a_scan():
    """A decoding step's one-query path closes over the same arrays; a function of the wrong
    arity or an integer result fails in one line naming ``score_mod``, inside the scan too."""
    q, k, v, do_L, slopes_LN, offs_LB, flags_LN = _inputs()
    q1 = jnp.asarray(q[:, -1:], F32)
    k32, v32 = jnp.asarray(k, F32), jnp.asarray(v, F32)
    mask = MaskSpec.for_sequence(1, T, offset=T - 1, causal=True)

    def step(slope_N, off_B, flag_N):
        mod = offset_mod(slope_N, off_B, flag_N)
        return flex_attention(q1, k32, v32, score_mod=mod, mask=mask, q_offset=T - 1)

    got = jax.jit(jax.vmap(step))(jnp.asarray(slopes_LN, F32), offs_LB, flags_LN)
    want = float64_reference(q, k, v, do_L, slopes_LN, offs_LB, flags_LN)[0][:, :, -1:]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    off_B = jnp.asarray(offs_LB[0])
    bad = {
        "five positional arguments": lambda s, b, h, q_idx: s,
        "float logits": lambda s, b, h, q_idx, kv_idx: s.astype(jnp.int32) + kv_idx + off_B[b],
        "shape": lambda s, b, h, q_idx, kv_idx: jnp.sum(s) + off_B[0],
    }
    for words, mod in bad.items():
        for T_q in (T, 1):

            def layer(c, off, mod=mod, T_q=T_q):
                out = flex_attention(q1 if T_q == 1 else jnp.asarray(q, F32), k32, v32,
                                     score_mod=mod, implementation="chunked")  # fmt: skip
                return c, out

            with pytest.raises(ValueError, match=f"score_mod.*{words}") as info:
                jax.lax.scan(layer, 0, jnp.asarray(offs_LB))
            assert "\n" not in str(info.value)


# A variant as a model uses one: a mixer whose score function closes over its float
# parameter, the call's integer positions (an offset per token) and a boolean per row.


@attnlab.register_mixer("closure_test_mha", overwrite=True)
class OffsetAttention(Attention):
    """``mha`` with ``offset_mod``'s score, its offset and flag taken from the positions."""

    @dataclasses.dataclass(frozen=True)
    class Settings(Attention.Settings):
        pass

    def __init__(self, cfg, settings=None, *, rngs):
        super().__init__(cfg, settings, rngs=rngs)
        self.slope_N = nnx.Param(jnp.linspace(-1.0, 1.0, cfg.n_heads))

    def __call__(self, x_BTD, call):
        q_BTNH = self.query(x_BTD, call)
        cache, k_BSKH, v_BSKH = self.keys_values(x_BTD, call)
        off_BT = call.positions_BT % 3  # int32, traced inside the layer scan
        odd_B = call.positions_BT[:, 0] % 2 == 0  # bool
        slope_N = self.slope_N[...]

        def mod(s, b, h, q_idx, kv_idx):
            sign = jnp.where(odd_B[b], 1.0, -0.5)
            return s + 0.1 * slope_N[h] * sign * (kv_idx - q_idx - off_BT[b, q_idx]).astype(F32)

        out_BTNH, weights = self.attend(q_BTNH, k_BSKH, v_BSKH, call, score_mod=mod)
        return self.output(out_BTNH, x_BTD), cache, weights


MODEL = dict(vocab_size=40, d_model=16, n_layers=2, n_heads=N, n_kv_heads=K, max_len=T,
             init_std=0.3, mixer="closure_test_mha")  # fmt: skip


def test_a_model_closing_over_integer_arrays_trains_scanned_and_unstacked():
    """``jit(grad)`` through the scanned and the unstacked stack (the chunked path, its
    custom VJP) equals the dense reference path's plain autodiff, slope gradients included."""
    ids_BT = jax.random.randint(jax.random.key(0), (B, T), 1, 40)
    weights_BTV = jax.random.normal(jax.random.key(1), (B, T, 40))

    def grads(scan, implementation):
        cfg = ModelConfig(**MODEL, scan_layers=scan, attention_impl=implementation)
        model = build_model(cfg, seed=0)
        graphdef, params = nnx.split(model)
        loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids_BT).logits * weights_BTV)
        value, g = jax.jit(jax.value_and_grad(loss))(params)
        flat = {"/".join(map(str, k)): np.asarray(x) for k, x in nnx.to_flat_state(g)}
        slopes = [x for name, x in flat.items() if name.endswith("slope_N")]
        assert slopes and all(np.abs(s).max() > 0 for s in slopes)
        return float(value), np.concatenate([s.reshape(-1) for s in slopes]), flat

    want_value, want_slopes, want = grads(True, "reference")
    for scan in (True, False):
        value, slopes, got = grads(scan, "auto")
        np.testing.assert_allclose(value, want_value, rtol=1e-5)
        np.testing.assert_allclose(slopes, want_slopes, atol=1e-4, rtol=1e-4)
        if scan:  # the same parameter tree as the reference's
            for name, g in want.items():
                np.testing.assert_allclose(got[name], g, atol=1e-4, rtol=1e-4, err_msg=name)


def test_differentiable_says_which_hoisted_arrays_take_a_gradient():
    mod = offset_mod(jnp.ones(N), jnp.zeros(B, jnp.int32), jnp.ones(N, bool))
    fn, consts = score_mods.convert(mod, (B, K, N // K, BLOCK, BLOCK))
    kinds = {c.dtype.kind for c in consts}
    assert kinds >= {"f"} and score_mods.differentiable(consts).count(True) >= 1
    assert [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts] == list(
        score_mods.differentiable(consts)
    )


def test_ring_attention_bias_closing_over_an_integer_offset_in_a_layer_scan():
    """Ring attention's position bias (``ops.ring``, hoisted as the score functions are)
    closing over a traced integer offset: ``jit(grad)`` through a scan over layers, against
    ``jax.nn.dot_product_attention`` with the same bias as an array."""
    from attnlab.devices import sharding
    from attnlab.ops.context_parallel import context_parallel_attention

    q, k, v, do_L, slopes_LN, offs_LB, _ = (jnp.asarray(x) for x in _inputs())
    q, k, v, do_L, slopes_LN = (x.astype(F32) for x in (q, k, v, do_L, slopes_LN))
    pos_1T = jnp.arange(T, dtype=jnp.int32)[None]
    mesh = sharding.make_mesh({"context": 1})

    def bias(slope_N, off_B, q_pos, k_pos):
        rel = q_pos[:, None, :, None] + off_B[:, None, None, None] - k_pos[:, None, None, :]
        return -0.1 * slope_N[None, :, None, None] * jnp.abs(rel).astype(F32)

    def ring(q, k, v, slope_N, off_B):  # one device on the context axis: a ring of one chunk
        return context_parallel_attention(
            q, k, v, mesh=mesh, q_pos_BT=pos_1T, k_pos_BS=pos_1T, causal=True,
            bias_fn=lambda slope_N, qp, kp: bias(slope_N, off_B, qp, kp), bias_params=slope_N,
            load_balance=False,
        )  # fmt: skip

    def dense(q, k, v, slope_N, off_B):
        b = bias(slope_N, off_B, pos_1T, pos_1T)
        causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
        return jax.nn.dot_product_attention(q, k, v, bias=b, mask=causal)

    def loss(attend):
        def total(q, slopes_LN):
            def layer(c, xs):
                slope_N, off_B, do = xs
                return c + jnp.sum(attend(q, k, v, slope_N, off_B) * do), None

            return jax.lax.scan(layer, jnp.float32(0), (slopes_LN, offs_LB, do_L))[0]

        return jax.jit(jax.value_and_grad(total, argnums=(0, 1)))(q, slopes_LN)

    (got, got_grads), (want, want_grads) = loss(ring), loss(dense)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5)
