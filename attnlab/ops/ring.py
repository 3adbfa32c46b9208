"""Ring attention: this device's queries over every device's key/value chunks, passed
round the mesh's context axis, with an online softmax and a custom VJP.

The algorithm, the layouts and the memory it keeps are described in
``attnlab.ops.context_parallel``, which calls it under ``shard_map``; the mask of one (query
chunk, key chunk) pair is ``ops.shards.chunk_mask``, evaluated from positions.

A score function (``score_mod(score, b, h, q_idx, kv_idx)``, ``attnlab.ops.score_mods``)
changes each block's logits after the bias and before the mask, with the block's tokens'
indices (their positions unless others are given) travelling with the chunks. The arrays
it closes over, of any dtype, are hoisted out and made varying like the queries
(``attnlab.ops.shard_scores``), so the custom backward pass pulls each block's ``dS`` back
through the function (``jax.vjp``) and sums the float arrays' gradients with no collective
inside the skip's ``lax.cond``. Logits, the online softmax and the gradients are in
``precision.wide`` of the inputs: float32 for bfloat16 and float32, float64 for float64.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from attnlab.ops import score_mods
from attnlab.ops.attention import to_BKGTS
from attnlab.ops.linear import fold
from attnlab.ops.masks import MASK_VALUE
from attnlab.ops.precision import wide
from attnlab.ops.shard_scores import block_indices, hoist, modded
from attnlab.ops.shards import Rules, full_meta, meta_mask, prepare, vary_like

META = ("pos", "segment", "valid", "index")  # what travels with a key chunk besides k and v


def _parts(x, n):
    """``[n, B|1, T/n, ...]``: the n parts of the sequence axis of ``[B|1, T, ...]``."""
    return jnp.moveaxis(x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]), 1, 0)


def _unparts(x):
    """The inverse of ``_parts``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _take(tree, index):
    return jax.tree.map(lambda x: x[index], tree)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static part of one ring attention call."""

    axis_name: str
    n: int  # parts per chunk: 2 in the zigzag layout, else 1
    causal: bool
    scale: float
    rate: float  # attention dropout; 0 for none
    key_impl: Any  # the dropout key's PRNG implementation
    bias: Callable | None  # bias(q_pos, k_pos, *bias_args), its arrays hoisted
    mod: Callable | None  # mod(score, b, h, q_idx, kv_idx, *mod_args), its arrays hoisted


def _scores(ring, q_BTKGH, k_BSKH, q_meta, k_meta, bias_args):
    """One block's logits in ``wide`` of the inputs, scaled and biased (before the score
    function and the mask)."""
    B, T, K, G, _ = q_BTKGH.shape
    S = k_BSKH.shape[1]
    cdt = wide(q_BTKGH, k_BSKH)
    s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=cdt)
    s_BKGTS = s_BKGTS * jnp.asarray(ring.scale, cdt)
    if ring.bias is not None:
        bias = ring.bias(q_meta["pos"], k_meta["pos"], *bias_args)
        s_BKGTS = s_BKGTS + to_BKGTS(bias, B, K, G, T, S).astype(cdt)
    return s_BKGTS


def _masked(s_BKGTS, q_meta, k_meta, ring, window):
    """``s`` with the masked entries at ``MASK_VALUE``, and the ``[B|1,1,1,T,S]`` mask."""
    mask = meta_mask(q_meta, k_meta, ring.causal, window)
    if mask is None:
        return s_BKGTS, None
    mask_B11TS = mask[:, :, None]
    return jnp.where(mask_B11TS, s_BKGTS, MASK_VALUE), mask_B11TS


def _logits(ring, q_BTKGH, k_BSKH, q_meta, k_meta, window, bias_args, mod_args):
    """One block's logits, scaled, biased, modified and masked, and its mask."""
    s_BKGTS = _scores(ring, q_BTKGH, k_BSKH, q_meta, k_meta, bias_args)
    s_BKGTS = modded(ring.mod, s_BKGTS, q_meta, k_meta, mod_args)
    return _masked(s_BKGTS, q_meta, k_meta, ring, window)


def _keep(ring, key_data, me, src, i, j, shape):
    """Attention dropout's keep mask of query part ``i`` of this device and key part ``j``
    of device ``src``'s chunk: the same bits in the forward and the backward pass."""
    key = jax.random.wrap_key_data(key_data, impl=ring.key_impl)
    key = fold(key, me * ring.n + i, src * ring.n + j)
    return jax.random.bernoulli(key, 1.0 - ring.rate, shape)


def _blocks(n, block, carry):
    """``block(carry, ij)`` over the n x n (query part, key part) pairs: a scan, so the
    program holds one block however many there are."""
    if n == 1:
        return block(carry, 0)[0]
    return lax.scan(block, carry, jnp.arange(n * n))[0]


def _sizes(ring, q_BTNH, k_BSKH):
    """``(n, axis name, C, me, (B, T, N, H, K, G), compute dtype)``: the ring's chunks, its
    mesh axis, that axis's size and this device's place on it, and the local shapes."""
    name = ring.axis_name
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    shapes = (B, T, N, H, K, N // K)
    return ring.n, name, lax.axis_size(name), lax.axis_index(name), shapes, wide(q_BTNH, k_BSKH)


def _ring_forward(
    ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, mod_args, key_data
):
    """The ring's output and each query's log-sum-exp ``[n, B, K, G, T/n]``."""
    n, name, C, me, (B, T, N, H, K, G), cdt = _sizes(ring, q_BTNH, k_BSKH)
    q_nBTKGH = _parts(q_BTNH.reshape(B, T, K, G, H), n)
    q_meta_n = jax.tree.map(lambda x: _parts(x, n), q_meta)

    def visit(stats, kv, src):
        """Updates every query part's online softmax by every part of ``src``'s chunk."""
        kv_n = jax.tree.map(lambda x: _parts(x, n), kv)

        def block(stats, ij):
            i, j = ij // n, ij % n
            chunk, q_m = _take(kv_n, j), _take(q_meta_n, i)
            k_m = {key: chunk[key] for key in META if key in chunk}

            def update(st):
                m_BKGT, l_BKGT, acc_BKGTH = st
                s_BKGTS, mask = _logits(
                    ring, q_nBTKGH[i], chunk["k"], q_m, k_m, window, bias_args, mod_args
                )
                m_new_BKGT = jnp.maximum(m_BKGT, s_BKGTS.max(-1))
                correction_BKGT = jnp.exp(m_BKGT - m_new_BKGT)
                p_BKGTS = jnp.exp(s_BKGTS - m_new_BKGT[..., None])
                if mask is not None:
                    p_BKGTS = jnp.where(mask, p_BKGTS, 0.0)
                l_BKGT = l_BKGT * correction_BKGT + p_BKGTS.sum(-1)
                if ring.rate:  # dropout after the softmax: the normaliser counts every key
                    keep = _keep(ring, key_data, me, src, i, j, p_BKGTS.shape)
                    p_BKGTS = jnp.where(keep, p_BKGTS / (1.0 - ring.rate), 0.0)
                pv_BKGTH = jnp.einsum(
                    "BKGTS,BSKH->BKGTH",
                    p_BKGTS.astype(chunk["v"].dtype),
                    chunk["v"],
                    preferred_element_type=cdt,
                )
                return m_new_BKGT, l_BKGT, acc_BKGTH * correction_BKGT[..., None] + pv_BKGTH

            mine = _take(stats, i)
            mask = meta_mask(q_m, k_m, ring.causal, window)
            if mask is None:
                mine = update(mine)
            else:  # skip blocks the rules rule out (causal: future chunks)
                mine = lax.cond(mask.any(), update, lambda st: st, mine)
            return jax.tree.map(lambda all_, x: all_.at[i].set(x), stats, mine), None

        return _blocks(n, block, stats)

    ring_perm = [(d, (d + 1) % C) for d in range(C)]

    def step(carry, s):
        stats, kv = carry
        passed = jax.tree.map(lambda x: lax.ppermute(x, name, ring_perm), kv)
        return (visit(stats, kv, (me - s) % C), passed), None

    zero_nBKGTH = jnp.zeros_like(jnp.moveaxis(q_nBTKGH, 2, 4), cdt)
    zero_nBKGT = zero_nBKGTH[..., 0]
    stats = (zero_nBKGT + MASK_VALUE, zero_nBKGT, zero_nBKGTH)  # m, l, acc of each part
    kv = {"k": k_BSKH, "v": v_BSKH, **kv_meta}
    if C > 1:
        (stats, kv), _ = lax.scan(step, (stats, kv), jnp.arange(C - 1))
    m_nBKGT, l_nBKGT, acc_nBKGTH = visit(stats, kv, (me - (C - 1)) % C)
    seen_nBKGT = l_nBKGT > 0  # rows with no allowed key give zeros
    l_nBKGT = jnp.where(seen_nBKGT, l_nBKGT, 1.0)
    out_nBTKGH = jnp.moveaxis(acc_nBKGTH / l_nBKGT[..., None], 4, 2)
    out_BTNH = _unparts(out_nBTKGH).reshape(B, T, N, H).astype(q_BTNH.dtype)
    return out_BTNH, jnp.where(seen_nBKGT, m_nBKGT + jnp.log(l_nBKGT), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, mod_args, key_data):
    args = (q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, mod_args, key_data)
    return _ring_forward(ring, *args)[0]


def _ring_fwd(ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, mod_args, key_data):
    args = (q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, mod_args, key_data)
    out_BTNH, lse_nBKGT = _ring_forward(ring, *args)
    return out_BTNH, (args, out_BTNH, lse_nBKGT)


def _ring_bwd(ring, residuals, dout_BTNH):
    """Gradients by a second trip round the ring: the key/value chunks travel again, each
    with the gradient of its keys and values accumulated so far, which a last transfer
    brings home. Probabilities are recomputed from the saved log-sum-exp."""
    args, out, lse = residuals
    q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, mod_args, key_data = args
    n, name, C, me, (B, T, N, H, K, G), cdt = _sizes(ring, q_BTNH, k_BSKH)
    split = lambda x: _parts(x.reshape(B, T, K, G, H), n)
    q_nBTKGH, do_nBTKGH = split(q_BTNH), split(dout_BTNH).astype(cdt)
    delta_nBKGT = jnp.einsum("nBTKGH,nBTKGH->nBKGT", do_nBTKGH, split(out).astype(cdt))
    q_meta_n = jax.tree.map(lambda x: _parts(x, n), q_meta)
    scale = jnp.asarray(ring.scale, cdt)
    wants = score_mods.differentiable(bias_args)  # integer and boolean arrays take none
    mod_wants = score_mods.differentiable(mod_args)
    mod_floats = score_mods.floats(mod_args, mod_wants)

    def visit(carry, kv, src):
        dq_nBTKGH, dkv, d_args, d_mod = carry
        kv_n = jax.tree.map(lambda x: _parts(x, n), kv)

        def block(carry, ij):
            dq_nBTKGH, dkv_n, d_args, d_mod = carry
            i, j = ij // n, ij % n
            chunk, q_m = _take(kv_n, j), _take(q_meta_n, i)
            k_m = {key: chunk[key] for key in META if key in chunk}
            q_BTKGH, do_BTKGH = q_nBTKGH[i], do_nBTKGH[i]
            k_BSKH, v_BSKH = chunk["k"], chunk["v"]

            def grads(d_mod):
                s_BKGTS = _scores(ring, q_BTKGH, k_BSKH, q_m, k_m, bias_args)
                if ring.mod is not None:  # pulled back per block; its arrays vary like q
                    mod = lambda s, f: modded(
                        ring.mod, s, q_m, k_m, score_mods.merge(mod_args, f, mod_wants)
                    )
                    s_BKGTS, mod_vjp = jax.vjp(mod, s_BKGTS, mod_floats)
                s_BKGTS, mask = _masked(s_BKGTS, q_m, k_m, ring, window)
                p_BKGTS = jnp.exp(s_BKGTS - lse[i][..., None])
                if mask is not None:
                    p_BKGTS = jnp.where(mask, p_BKGTS, 0.0)
                wide_ = dict(preferred_element_type=cdt)
                dp_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", do_BTKGH, v_BSKH, **wide_)
                used_BKGTS = p_BKGTS
                if ring.rate:
                    keep = _keep(ring, key_data, me, src, i, j, p_BKGTS.shape)
                    used_BKGTS = jnp.where(keep, p_BKGTS / (1.0 - ring.rate), 0.0)
                    dp_BKGTS = jnp.where(keep, dp_BKGTS / (1.0 - ring.rate), 0.0)
                ds_BKGTS = p_BKGTS * (dp_BKGTS - delta_nBKGT[i][..., None])
                if ring.mod is not None:  # d logits before the score function
                    ds_BKGTS, dm = mod_vjp(ds_BKGTS)
                    d_mod = tuple(a + g.astype(a.dtype) for a, g in zip(d_mod, dm, strict=True))
                dq = jnp.einsum("BKGTS,BSKH->BTKGH", ds_BKGTS, k_BSKH, **wide_) * scale
                dk = jnp.einsum("BKGTS,BTKGH->BSKH", ds_BKGTS, q_BTKGH, **wide_) * scale
                dv = jnp.einsum("BKGTS,BTKGH->BSKH", used_BKGTS, do_BTKGH, **wide_)
                return dq, dk, dv, ds_BKGTS, d_mod

            def skip(d_mod):
                zeros = lambda x: jnp.zeros_like(x, cdt)
                ds = vary_like(jnp.zeros((B, K, G, T // n, k_BSKH.shape[1]), cdt), q_BTKGH)
                return zeros(q_BTKGH), zeros(k_BSKH), zeros(v_BSKH), ds, d_mod

            mask = meta_mask(q_m, k_m, ring.causal, window)
            if mask is None:
                dq, dk, dv, ds, d_mod = grads(d_mod)
            else:  # blocks the rules rule out contribute nothing
                dq, dk, dv, ds, d_mod = lax.cond(mask.any(), grads, skip, d_mod)
            dq_nBTKGH = dq_nBTKGH.at[i].add(dq)
            dkv_n = {"k": dkv_n["k"].at[j].add(dk), "v": dkv_n["v"].at[j].add(dv)}
            if ring.bias is not None:  # outside the cond: it may hold a psum (see ring_attention)
                Tn, Sn = ds.shape[-2:]

                def bias_BKGTS(*floats):
                    args = score_mods.merge(bias_args, floats, wants)
                    bias = ring.bias(q_m["pos"], k_m["pos"], *args)
                    return to_BKGTS(bias, B, K, G, Tn, Sn).astype(cdt)

                floats = score_mods.floats(bias_args, wants)
                d_args = jax.tree.map(jnp.add, d_args, jax.vjp(bias_BKGTS, *floats)[1](ds))
            return (dq_nBTKGH, dkv_n, d_args, d_mod), None

        dkv_n = jax.tree.map(lambda x: _parts(x, n), dkv)
        dq_nBTKGH, dkv_n, d_args, d_mod = _blocks(n, block, (dq_nBTKGH, dkv_n, d_args, d_mod))
        return dq_nBTKGH, jax.tree.map(_unparts, dkv_n), d_args, d_mod

    ring_perm = [(d, (d + 1) % C) for d in range(C)]
    send = lambda tree: jax.tree.map(lambda x: lax.ppermute(x, name, ring_perm), tree)

    def step(carry, s):
        grads, kv = carry
        passed = send(kv)  # the next chunk moves while this one is worked on
        dq, dkv, d_args, d_mod = visit(grads, kv, (me - s) % C)
        return ((dq, send(dkv), d_args, d_mod), passed), None

    kv = {"k": k_BSKH, "v": v_BSKH, **kv_meta}
    zeros = lambda x: jnp.zeros_like(x, cdt)
    grads = (zeros(q_nBTKGH), {"k": zeros(k_BSKH), "v": zeros(v_BSKH)})
    grads += (tuple(jnp.zeros_like(a) for a in score_mods.floats(bias_args, wants)),)
    grads += (tuple(zeros(a) for a in mod_floats),)
    if C > 1:
        (grads, kv), _ = lax.scan(step, (grads, kv), jnp.arange(C - 1))
    dq_nBTKGH, dkv, d_args, d_mod = visit(grads, kv, (me - (C - 1)) % C)
    dkv = send(dkv)  # the last chunk's gradients go home
    dq_BTNH = _unparts(dq_nBTKGH).reshape(B, T, N, H).astype(q_BTNH.dtype)
    dk_BSKH, dv_BSKH = dkv["k"].astype(k_BSKH.dtype), dkv["v"].astype(v_BSKH.dtype)
    d_args = score_mods.merge(tuple(map(score_mods.no_gradient, bias_args)), d_args, wants)
    d_mod = tuple(g.astype(a.dtype) for g, a in zip(d_mod, mod_floats, strict=True))
    d_mod = score_mods.merge(tuple(map(score_mods.no_gradient, mod_args)), d_mod, mod_wants)
    return dq_BTNH, dk_BSKH, dv_BSKH, None, None, None, d_args, d_mod, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q_BTNH, k_BSKH, v_BSKH, q_meta, k_meta, rules: Rules):
    """Ring attention of this device's queries over every device's keys; inside
    ``shard_map`` over ``rules.axis_name``. Arguments are this device's chunks and their
    metadata (``attnlab.ops.shards``).

    The tokens' positions are what the mask rules (see ``chunk_mask``) and
    ``rules.bias_fn(q_pos_BT, k_pos_BS) -> [B|1, N|1, T, S]`` (this device's heads) read.
    ``rules.score_mod(score, b, h, q_idx, kv_idx)`` (``attnlab.ops.score_mods``) changes
    each block's logits after the bias: ``b`` and ``h`` index this call's batch rows and
    query heads, ``q_idx``/``kv_idx`` are the tokens' ``"index"`` (default: the positions),
    in whatever layout the chunks are. ``rules.load_balance``: the chunks are zigzag pairs
    (see ``to_zigzag``), so each is attended as two halves and the (query half, key half)
    blocks that the mask rules out are skipped; without it, whole chunks are skipped.
    Attention dropout (``rules.dropout_key``) draws each block's bits from the key folded
    with the block's chunk ids: a valid dropout, not the bits of the dense path.
    ``rules.scale`` is a Python number (part of the program).
    """
    (B, T, N, H, K, G), scale = prepare(q_BTNH, k_BSKH, v_BSKH, rules.scale)
    n = 2 if rules.load_balance else 1
    S = k_BSKH.shape[1]
    if T % n or S % n:
        raise ValueError(f"ring_attention(load_balance=True) needs even chunks, got T={T}, S={S}")
    dropout_key, score_mod = rules.dropout_key, rules.score_mod
    drop = dropout_key is not None and rules.dropout_rate > 0.0
    q_meta = full_meta(q_meta, T, score_mod)
    kv_meta = full_meta(k_meta, S, score_mod)
    # A collective inside a branch of the skip's lax.cond would wait for devices that took
    # the other branch, and autodiff puts one (a psum, the transpose of an implicit pvary)
    # where a float that varies over fewer mesh axes than the queries meets them. So k and v
    # are made varying here, and the bias's arrays (perhaps a table replicated over the
    # ring) become explicit arguments whose gradient is taken outside the cond; the score
    # function's arrays are made varying too, so its pullback inside the cond holds none.
    k_BSKH, v_BSKH = vary_like(k_BSKH, q_BTNH), vary_like(v_BSKH, q_BTNH)
    first = lambda meta: jax.tree.map(lambda x: _parts(x, n)[0], meta)
    bias, bias_args = None, ()
    if rules.bias_fn is not None:
        example = (q_meta["pos"][:, : T // n], kv_meta["pos"][:, : S // n])
        bias, bias_args = score_mods.hoist(rules.bias_fn, *example)  # arrays of any dtype
    mod, mod_args = None, ()
    if score_mod is not None:
        shape = (B, K, G, T // n, S // n)
        s_BKGTS = vary_like(jnp.zeros(shape, wide(q_BTNH, k_BSKH)), q_BTNH)
        example = (s_BKGTS, *block_indices(B, K, G, first(q_meta), first(kv_meta)))
        mod, mod_args = hoist(score_mod, example, like=q_BTNH)  # arrays of any dtype
    ring = _Ring(
        axis_name=rules.axis_name,
        n=n,
        causal=bool(rules.causal),
        scale=float(scale),
        rate=float(rules.dropout_rate) if drop else 0.0,
        key_impl=jax.random.key_impl(dropout_key) if drop else None,
        bias=bias,
        mod=mod,
    )
    window = None if rules.window is None else jnp.asarray(rules.window, jnp.int32)
    key_data = jax.random.key_data(dropout_key) if drop else None
    return _ring(
        ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, tuple(bias_args), mod_args,
        key_data,
    )  # fmt: skip
