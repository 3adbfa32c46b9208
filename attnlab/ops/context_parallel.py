"""Context parallelism: self-attention over a sequence split across devices along T.

With C devices on the mesh's ``context`` axis, each holds T/C queries and the keys and
values of the same T/C tokens. Two ways to attend, both pure functions called inside
``jax.shard_map`` over that axis (``context_parallel_attention`` does the ``shard_map``):

* ``ring_attention``: each device keeps its queries and passes its key/value chunk round
  the ring (``lax.ppermute`` to the next device, C - 1 times), together with the chunk's
  positions, segment ids and validity. Each visit updates an online softmax in float32
  (running max, normaliser and unnormalised output), so no device ever holds more than
  two chunks of keys. The transfer of the next chunk does not depend on the work on the
  current one, so XLA can overlap them.
* ``all_gather_attention``: each device gathers every key and value (``lax.all_gather``)
  and attends its queries over all of them in one dense call (``dot_product_attention``,
  any implementation): one collective instead of C - 1, but the whole K/V and a ``[T/C,
  T]`` score matrix per device.

Masks are never ``[T, S]`` arrays: ``chunk_mask`` evaluates causal, sliding-window,
segment (packed documents) and key-validity rules for one (query chunk, key chunk) pair
from the chunks' positions, and a position bias (ALiBi, T5 relative) is a function of the
positions, ``bias_fn(q_pos_BT, k_pos_BS)``, evaluated per pair too. Because every rule
reads positions rather than array indices, the functions do not care how tokens are laid
out over the devices. A query row whose keys are all masked gives zeros (finite
gradients), as ``dot_product_attention`` does. K/V keep their K heads (GQA/MQA): queries
are grouped ``[.., K, G, ..]``, never K/V repeated.

Load balancing. Under a causal mask the device holding the last chunk of a contiguous
split attends to everything and the first to almost nothing, and a ring moves at the pace
of its slowest device. The zigzag layout splits the sequence into 2C chunks and gives
device i chunks i and 2C-1-i (``zigzag_indices``): then at every ring step after the
first, each device has exactly two of its four (query half, key half) blocks to compute,
and ``ring_attention(load_balance=True)`` skips the other two (``lax.cond`` on whether the
block's mask allows anything). ``zigzag`` moves arrays between the contiguous and the
zigzag layout with two ``ppermute`` of half a chunk each. Positions travel with the
tokens, so RoPE, ALiBi and masks see the true positions in either layout.

Differentiation. ``ring_attention`` has a custom VJP. The forward pass keeps this
device's q, k, v, output and each query's log-sum-exp, nothing per step; the backward pass
goes round the ring again, recomputing each block's probabilities from the log-sum-exp,
with every key/value chunk travelling together with the gradient of its keys and values
accumulated so far, which one last transfer brings home. So memory stays O(T/C) per
device (plus one block's scores at a time) in training too, for twice the forward's
traffic and one recomputed ``q k^T`` per block. Plain autodiff through the loop would
instead keep every chunk the ring passed and the statistics of every step, O(T) per
device. (Forward-mode differentiation of the ring is not defined.)
``all_gather_attention`` is differentiated by plain autodiff: ``all_gather`` transposes to
a reduce-scatter of the key/value gradients, and the dense call keeps what its
implementation keeps (the reference: the ``[T/C, T]`` weights).

When each wins. The ring holds O(T/C) keys and, with the zigzag layout, skips half of
the causal work evenly; its C - 1 transfers hide behind compute when a block's matmuls
take longer than moving a chunk (long chunks, many heads per kv head). The all-gather
is simpler, runs any ``dot_product_attention`` implementation (a fused kernel on GPU)
and wins when K/V are small (few kv heads, moderate lengths, fast links) and the whole
K/V fits on each device; it also computes the masked half of causal attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from attnlab.ops.attention import _MASK_VALUE, _to_BKGTS, dot_product_attention

METHODS = ("ring", "all_gather")


def chunk_mask(
    q_pos_BT,
    k_pos_BS,
    *,
    causal=False,
    window=None,
    q_segment_BT=None,
    k_segment_BS=None,
    k_valid_BS=None,
):
    """``[B|1, 1, T, S]`` mask (True = may attend) of queries and keys at the given
    positions, or None when no rule applies.

    ``causal``: ``k <= q``; ``window`` (int or traced scalar): ``q - window < k <= q``, as
    ``masks.sliding_window`` (it implies causal); segments: equal non-zero ids, as
    ``masks.segment``; ``k_valid_BS``: real keys, as ``masks.padding``.
    """
    if (q_segment_BT is None) != (k_segment_BS is None):
        raise ValueError("chunk_mask: give both q_segment_BT and k_segment_BS, or neither")
    mask_BTS = None

    def both(a, b):
        return b if a is None else a & b

    if causal or window is not None:
        d_BTS = jnp.asarray(q_pos_BT)[:, :, None] - jnp.asarray(k_pos_BS)[:, None, :]
        mask_BTS = d_BTS >= 0
        if window is not None:
            mask_BTS = mask_BTS & (d_BTS < jnp.asarray(window, d_BTS.dtype))
    if q_segment_BT is not None:
        q_BT1, k_B1S = q_segment_BT[:, :, None], k_segment_BS[:, None, :]
        mask_BTS = both(mask_BTS, (q_BT1 == k_B1S) & (q_BT1 > 0) & (k_B1S > 0))
    if k_valid_BS is not None:
        mask_BTS = both(mask_BTS, jnp.asarray(k_valid_BS, bool)[:, None, :])
    return None if mask_BTS is None else mask_BTS[:, None]


def zigzag_indices(T: int, C: int) -> np.ndarray:
    """The token order of the zigzag layout: device i's T/C tokens are chunks i and
    2C-1-i of 2C equal chunks, devices in order (``x[:, zigzag_indices(T, C)]``)."""
    if T % (2 * C):
        raise ValueError(f"zigzag: T={T} must be a multiple of 2 x {C} devices")
    chunks = np.arange(T).reshape(2 * C, T // (2 * C))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * C - 1 - i]]) for i in range(C)])


def _zigzag_perms(C):
    """Where each device sends its first and its second half-chunk (contiguous -> zigzag).

    Device d holds chunks 2d and 2d+1; chunk c < C goes to device c (its first half), a
    chunk c >= C to device 2C-1-c (its second half)."""
    dest = lambda c: c if c < C else 2 * C - 1 - c
    return [(d, dest(2 * d)) for d in range(C)], [(d, dest(2 * d + 1)) for d in range(C)]


def to_zigzag(x, axis_name="context"):
    """The local chunk of ``x`` (sequence on axis 1, contiguous layout) in the zigzag
    layout; inside ``shard_map``. Even devices receive their first half from the even
    chunks' transfer, odd devices from the odd chunks'."""
    C = lax.axis_size(axis_name)
    perm0, perm1 = _zigzag_perms(C)
    half0, half1 = jnp.split(x, 2, axis=1)
    got0, got1 = lax.ppermute(half0, axis_name, perm0), lax.ppermute(half1, axis_name, perm1)
    even = lax.axis_index(axis_name) % 2 == 0
    return jnp.concatenate([jnp.where(even, got0, got1), jnp.where(even, got1, got0)], axis=1)


def from_zigzag(x, axis_name="context"):
    """The inverse of ``to_zigzag``: each half goes back the way it came."""
    C = lax.axis_size(axis_name)
    inverse = lambda perm: [(dst, src) for src, dst in perm]
    perm0, perm1 = _zigzag_perms(C)
    first, second = jnp.split(x, 2, axis=1)
    even = lax.axis_index(axis_name) % 2 == 0
    back0 = lax.ppermute(jnp.where(even, first, second), axis_name, inverse(perm0))
    back1 = lax.ppermute(jnp.where(even, second, first), axis_name, inverse(perm1))
    return jnp.concatenate([back0, back1], axis=1)


META = ("pos", "segment", "valid")  # what travels with a key chunk besides k and v


def _meta_mask(q_meta, k_meta, causal, window):
    return chunk_mask(
        q_meta["pos"],
        k_meta["pos"],
        causal=causal,
        window=window,
        q_segment_BT=q_meta.get("segment"),
        k_segment_BS=k_meta.get("segment"),
        k_valid_BS=k_meta.get("valid"),
    )


def _vary_like(x, like):
    """``x`` varying over every manual mesh axis that ``like`` varies over (inside
    ``shard_map``; unchanged outside it or without float values)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _varying(x) -> set:
    """The manual mesh axes ``x`` varies over (its type's varying-axes set)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)  # JAX 0.10; earlier releases: ``vma``
    return set(kind.varying if kind is not None else getattr(aval, "vma", ()))


def _fold(key, *data):
    if key is None:
        return None
    for d in data:
        key = jax.random.fold_in(key, d)
    return key


def _prepare(q_BTNH, k_BSKH, v_BSKH, scale):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    if k_BSKH.shape != v_BSKH.shape or N % K or k_BSKH.shape[3] != H:
        raise ValueError(
            f"context-parallel attention expects q [B, T, N, H] and k, v [B, S, K, H] with K "
            f"dividing N; got q={q_BTNH.shape}, k={k_BSKH.shape}, v={v_BSKH.shape}"
        )
    return (B, T, N, H, K, N // K), H**-0.5 if scale is None else scale


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
    bias: Callable | None  # bias(q_pos, k_pos, *bias_args), closure-converted


def _logits(ring, q_BTKGH, k_BSKH, q_meta, k_meta, window, bias_args):
    """One block's float32 logits, scaled, biased and masked, and its ``[B|1,1,1,T,S]`` mask."""
    B, T, K, G, _ = q_BTKGH.shape
    S = k_BSKH.shape[1]
    s_BKGTS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32
    ) * jnp.float32(ring.scale)
    if ring.bias is not None:
        bias = ring.bias(q_meta["pos"], k_meta["pos"], *bias_args)
        s_BKGTS = s_BKGTS + _to_BKGTS(bias, B, K, G, T, S).astype(jnp.float32)
    mask = _meta_mask(q_meta, k_meta, ring.causal, window)
    if mask is None:
        return s_BKGTS, None
    mask_B11TS = mask[:, :, None]
    return jnp.where(mask_B11TS, s_BKGTS, _MASK_VALUE), mask_B11TS


def _keep(ring, key_data, me, src, i, j, shape):
    """Attention dropout's keep mask of query part ``i`` of this device and key part ``j``
    of device ``src``'s chunk: the same bits in the forward and the backward pass."""
    key = jax.random.wrap_key_data(key_data, impl=ring.key_impl)
    key = _fold(key, me * ring.n + i, src * ring.n + j)
    return jax.random.bernoulli(key, 1.0 - ring.rate, shape)


def _blocks(n, block, carry):
    """``block(carry, ij)`` over the n x n (query part, key part) pairs: a scan, so the
    program holds one block however many there are."""
    if n == 1:
        return block(carry, 0)[0]
    return lax.scan(block, carry, jnp.arange(n * n))[0]


def _ring_forward(ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, key_data):
    """The ring's output and each query's log-sum-exp ``[n, B, K, G, T/n]``."""
    n, name = ring.n, ring.axis_name
    C, me = lax.axis_size(name), lax.axis_index(name)
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    G = N // K
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
                s_BKGTS, mask = _logits(ring, q_nBTKGH[i], chunk["k"], q_m, k_m, window, bias_args)
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
                    preferred_element_type=jnp.float32,
                )
                return m_new_BKGT, l_BKGT, acc_BKGTH * correction_BKGT[..., None] + pv_BKGTH

            mine = _take(stats, i)
            mask = _meta_mask(q_m, k_m, ring.causal, window)
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

    zero_nBKGTH = jnp.zeros_like(jnp.moveaxis(q_nBTKGH, 2, 4), jnp.float32)
    zero_nBKGT = zero_nBKGTH[..., 0]
    stats = (zero_nBKGT + _MASK_VALUE, zero_nBKGT, zero_nBKGTH)  # m, l, acc of each part
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
def _ring(ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, key_data):
    return _ring_forward(
        ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, key_data
    )[0]


def _ring_fwd(ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, key_data):
    args = (q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, key_data)
    out_BTNH, lse_nBKGT = _ring_forward(ring, *args)
    return out_BTNH, (args, out_BTNH, lse_nBKGT)


def _ring_bwd(ring, residuals, dout_BTNH):
    """Gradients by a second trip round the ring: the key/value chunks travel again, each
    with the gradient of its keys and values accumulated so far, which a last transfer
    brings home. Probabilities are recomputed from the saved log-sum-exp."""
    (q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, bias_args, key_data), out, lse = residuals
    n, name = ring.n, ring.axis_name
    C, me = lax.axis_size(name), lax.axis_index(name)
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    G = N // K
    split = lambda x: _parts(x.reshape(B, T, K, G, H), n)
    q_nBTKGH, do_nBTKGH = split(q_BTNH), split(dout_BTNH).astype(jnp.float32)
    delta_nBKGT = jnp.einsum("nBTKGH,nBTKGH->nBKGT", do_nBTKGH, split(out).astype(jnp.float32))
    q_meta_n = jax.tree.map(lambda x: _parts(x, n), q_meta)
    scale = jnp.float32(ring.scale)

    def visit(carry, kv, src):
        dq_nBTKGH, dkv, d_args = carry
        kv_n = jax.tree.map(lambda x: _parts(x, n), kv)

        def block(carry, ij):
            dq_nBTKGH, dkv_n, d_args = carry
            i, j = ij // n, ij % n
            chunk, q_m = _take(kv_n, j), _take(q_meta_n, i)
            k_m = {key: chunk[key] for key in META if key in chunk}
            q_BTKGH, do_BTKGH = q_nBTKGH[i], do_nBTKGH[i]
            k_BSKH, v_BSKH = chunk["k"], chunk["v"]

            def grads(_):
                s_BKGTS, mask = _logits(ring, q_BTKGH, k_BSKH, q_m, k_m, window, bias_args)
                p_BKGTS = jnp.exp(s_BKGTS - lse[i][..., None])
                if mask is not None:
                    p_BKGTS = jnp.where(mask, p_BKGTS, 0.0)
                dp_BKGTS = jnp.einsum(
                    "BTKGH,BSKH->BKGTS", do_BTKGH, v_BSKH, preferred_element_type=jnp.float32
                )
                used_BKGTS = p_BKGTS
                if ring.rate:
                    keep = _keep(ring, key_data, me, src, i, j, p_BKGTS.shape)
                    used_BKGTS = jnp.where(keep, p_BKGTS / (1.0 - ring.rate), 0.0)
                    dp_BKGTS = jnp.where(keep, dp_BKGTS / (1.0 - ring.rate), 0.0)
                ds_BKGTS = p_BKGTS * (dp_BKGTS - delta_nBKGT[i][..., None])
                f32 = dict(preferred_element_type=jnp.float32)
                dq = jnp.einsum("BKGTS,BSKH->BTKGH", ds_BKGTS, k_BSKH, **f32) * scale
                dk = jnp.einsum("BKGTS,BTKGH->BSKH", ds_BKGTS, q_BTKGH, **f32) * scale
                dv = jnp.einsum("BKGTS,BTKGH->BSKH", used_BKGTS, do_BTKGH, **f32)
                return dq, dk, dv, ds_BKGTS

            def skip(_):
                zeros = lambda x: jnp.zeros_like(x, jnp.float32)
                ds = _vary_like(jnp.zeros((B, K, G, T // n, k_BSKH.shape[1]), jnp.float32), q_BTKGH)
                return zeros(q_BTKGH), zeros(k_BSKH), zeros(v_BSKH), ds

            mask = _meta_mask(q_m, k_m, ring.causal, window)
            if mask is None:
                dq, dk, dv, ds = grads(None)
            else:  # blocks the rules rule out contribute nothing
                dq, dk, dv, ds = lax.cond(mask.any(), grads, skip, None)
            dq_nBTKGH = dq_nBTKGH.at[i].add(dq)
            dkv_n = {"k": dkv_n["k"].at[j].add(dk), "v": dkv_n["v"].at[j].add(dv)}
            if ring.bias is not None:  # outside the cond: it may hold a psum (see above)
                Tn, Sn = ds.shape[-2:]

                def bias_BKGTS(*args):
                    bias = ring.bias(q_m["pos"], k_m["pos"], *args)
                    return _to_BKGTS(bias, B, K, G, Tn, Sn).astype(jnp.float32)

                d_args = jax.tree.map(jnp.add, d_args, jax.vjp(bias_BKGTS, *bias_args)[1](ds))
            return (dq_nBTKGH, dkv_n, d_args), None

        dkv_n = jax.tree.map(lambda x: _parts(x, n), dkv)
        dq_nBTKGH, dkv_n, d_args = _blocks(n, block, (dq_nBTKGH, dkv_n, d_args))
        return dq_nBTKGH, jax.tree.map(_unparts, dkv_n), d_args

    ring_perm = [(d, (d + 1) % C) for d in range(C)]
    send = lambda tree: jax.tree.map(lambda x: lax.ppermute(x, name, ring_perm), tree)

    def step(carry, s):
        grads, kv = carry
        passed = send(kv)  # the next chunk moves while this one is worked on
        dq, dkv, d_args = visit(grads, kv, (me - s) % C)
        return ((dq, send(dkv), d_args), passed), None

    kv = {"k": k_BSKH, "v": v_BSKH, **kv_meta}
    zeros = lambda x: jnp.zeros_like(x, jnp.float32)
    grads = (zeros(q_nBTKGH), {"k": zeros(k_BSKH), "v": zeros(v_BSKH)})
    grads += (jax.tree.map(jnp.zeros_like, bias_args),)
    if C > 1:
        (grads, kv), _ = lax.scan(step, (grads, kv), jnp.arange(C - 1))
    dq_nBTKGH, dkv, d_args = visit(grads, kv, (me - (C - 1)) % C)
    dkv = send(dkv)  # the last chunk's gradients go home
    dq_BTNH = _unparts(dq_nBTKGH).reshape(B, T, N, H).astype(q_BTNH.dtype)
    dk_BSKH, dv_BSKH = dkv["k"].astype(k_BSKH.dtype), dkv["v"].astype(v_BSKH.dtype)
    return dq_BTNH, dk_BSKH, dv_BSKH, None, None, None, d_args, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    q_pos_BT,
    k_pos_BS,
    causal=False,
    window=None,
    q_segment_BT=None,
    k_segment_BS=None,
    k_valid_BS=None,
    bias_fn: Callable | None = None,
    scale=None,
    axis_name="context",
    load_balance=True,
    dropout_rate=0.0,
    dropout_key=None,
):
    """Ring attention of this device's queries over every device's keys; inside
    ``shard_map`` over ``axis_name``. Arguments are this device's chunks.

    ``q_pos_BT``/``k_pos_BS`` (``[B|1, ...]`` int) are the tokens' positions, which the
    mask rules (see ``chunk_mask``) and ``bias_fn(q_pos_BT, k_pos_BS) -> [B|1, N|1, T, S]``
    (this device's heads) read. ``load_balance``: the chunks are zigzag pairs (see
    ``to_zigzag``), so each is attended as two halves and the (query half, key half)
    blocks that the mask rules out are skipped; without it, whole chunks are skipped.
    Attention dropout (``dropout_key``) draws each block's bits from the key folded with
    the block's chunk ids: a valid dropout, not the bits of the dense path. ``scale`` is
    a Python number (part of the program).
    """
    (B, T, N, H, K, G), scale = _prepare(q_BTNH, k_BSKH, v_BSKH, scale)
    n = 2 if load_balance else 1
    S = k_BSKH.shape[1]
    if T % n or S % n:
        raise ValueError(f"ring_attention(load_balance=True) needs even chunks, got T={T}, S={S}")
    drop = dropout_key is not None and dropout_rate > 0.0
    q_meta = {"pos": jnp.broadcast_to(q_pos_BT, (q_pos_BT.shape[0], T))}
    if q_segment_BT is not None:
        q_meta["segment"] = q_segment_BT
    kv_meta = {"pos": jnp.broadcast_to(k_pos_BS, (k_pos_BS.shape[0], S))}
    for key, x in (("segment", k_segment_BS), ("valid", k_valid_BS)):
        if x is not None:
            kv_meta[key] = x
    # A collective inside a branch of the skip's lax.cond would wait for devices that took
    # the other branch, and autodiff puts one (a psum, the transpose of an implicit pvary)
    # where a float that varies over fewer mesh axes than the queries meets them. So k and v
    # are made varying here, and the bias's arrays (perhaps a table replicated over the
    # ring) become explicit arguments whose gradient is taken outside the cond.
    k_BSKH, v_BSKH = _vary_like(k_BSKH, q_BTNH), _vary_like(v_BSKH, q_BTNH)
    bias, bias_args = None, ()
    if bias_fn is not None:
        example = (q_meta["pos"][:, : T // n], kv_meta["pos"][:, : S // n])
        bias, bias_args = jax.closure_convert(bias_fn, *example)
    ring = _Ring(
        axis_name=axis_name,
        n=n,
        causal=bool(causal),
        scale=float(scale),
        rate=float(dropout_rate) if drop else 0.0,
        key_impl=jax.random.key_impl(dropout_key) if drop else None,
        bias=bias,
    )
    window = None if window is None else jnp.asarray(window, jnp.int32)
    key_data = jax.random.key_data(dropout_key) if drop else None
    return _ring(ring, q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, window, tuple(bias_args), key_data)


def all_gather_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    q_pos_BT,
    k_pos_BS,
    causal=False,
    window=None,
    q_segment_BT=None,
    k_segment_BS=None,
    k_valid_BS=None,
    bias_fn: Callable | None = None,
    scale=None,
    axis_name="context",
    load_balance=True,
    dropout_rate=0.0,
    dropout_key=None,
    implementation="reference",
):
    """This device's queries over every device's keys, gathered (``lax.all_gather``);
    inside ``shard_map`` over ``axis_name``. The arguments are those of
    ``ring_attention`` (``load_balance`` is accepted and changes nothing: the work is the
    same on every device), plus the ``dot_product_attention`` implementation."""
    del load_balance
    _, scale = _prepare(q_BTNH, k_BSKH, v_BSKH, scale)

    def gather(x):
        return None if x is None else lax.all_gather(x, axis_name, axis=1, tiled=True)

    k_pos_BS = jnp.broadcast_to(k_pos_BS, (k_pos_BS.shape[0], k_BSKH.shape[1]))
    all_pos_BS = gather(k_pos_BS)
    mask = chunk_mask(
        q_pos_BT,
        all_pos_BS,
        causal=causal,
        window=window,
        q_segment_BT=q_segment_BT,
        k_segment_BS=gather(k_segment_BS),
        k_valid_BS=gather(k_valid_BS),
    )
    return dot_product_attention(
        q_BTNH,
        gather(k_BSKH),
        gather(v_BSKH),
        mask=mask,
        bias=None if bias_fn is None else bias_fn(q_pos_BT, all_pos_BS),
        scale=scale,
        implementation=implementation,
        dropout_rate=dropout_rate,
        dropout_key=_fold(dropout_key, lax.axis_index(axis_name)),
    )


def _fit(mesh, axes, size, taken=()):
    """The axes among ``axes`` (larger than 1, not ``taken``) that evenly split ``size``:
    greedily, as ``sharding.constrain`` places an activation."""
    out = []
    for axis in axes:
        if axis in taken or mesh.shape[axis] == 1:
            continue
        if size % (math.prod(mesh.shape[a] for a in out) * mesh.shape[axis]) == 0:
            out.append(axis)
    return tuple(out)


def _spec_axes(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def context_parallel_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    mesh,
    method="ring",
    q_pos_BT,
    k_pos_BS,
    causal=False,
    window=None,
    q_segment_BT=None,
    k_segment_BS=None,
    k_valid_BS=None,
    bias_fn: Callable | None = None,
    bias_params=None,
    scale=None,
    load_balance=True,
    implementation="reference",
    dropout_rate=0.0,
    dropout_key=None,
    axis_name="context",
    batch_axes=("data", "fsdp"),
    head_axes=("tensor",),
):
    """``ring_attention`` or ``all_gather_attention`` (``method``) of global arrays, under
    ``shard_map`` on ``mesh`` (a ``Mesh`` or the current abstract mesh).

    The sequence axis is split over ``axis_name`` (T must be a multiple of its size; twice
    that with ``load_balance``, for which the caller puts the arrays in the zigzag layout
    with ``zigzag`` and takes the output back), the batch over ``batch_axes`` and the heads
    over ``head_axes``, each where the size divides (as ``sharding.constrain`` places
    activations). When the kv heads are fewer
    than the head shards, each shard slices the one kv head its query heads share.
    ``bias_fn(bias_params, q_pos_BT, k_pos_BS) -> [B|1, N, T, S]`` is a position bias whose
    parameters have the heads on their last axis (ALiBi slopes ``[N]``, a relative table
    ``[X, N]``); they are split with the heads. ``window`` may be traced.
    """
    if method not in METHODS:
        raise ValueError(f"context parallelism method={method!r}: use one of {METHODS}")
    B, T, N, _ = q_BTNH.shape
    K = k_BSKH.shape[2]
    C = mesh.shape[axis_name]
    if T % (C * (2 if load_balance else 1)) or k_BSKH.shape[1] != T:
        raise ValueError(
            f"context parallelism over {C} devices needs T = S divisible by "
            f"{C * (2 if load_balance else 1)}; got T={T}, S={k_BSKH.shape[1]}"
        )
    batch = _fit(mesh, batch_axes, B, taken=(axis_name,))
    heads = _fit(mesh, head_axes, N, taken=(axis_name, *batch))
    shards = math.prod(mesh.shape[a] for a in heads)
    slice_kv = K % shards != 0
    if slice_kv and shards % K:
        heads, shards, slice_kv = (), 1, False  # no head split fits both: keep heads whole
    b, c, h = _spec_axes(batch), axis_name, _spec_axes(heads)
    rows = lambda x: b if x.shape[0] > 1 else None
    args = {"q": q_BTNH, "k": k_BSKH, "v": v_BSKH, "q_pos": q_pos_BT, "k_pos": k_pos_BS}
    specs = {
        "q": P(b, c, h, None),
        "k": P(b, c, None if slice_kv else h, None),
        "v": P(b, c, None if slice_kv else h, None),
        "q_pos": P(rows(q_pos_BT), c),
        "k_pos": P(rows(k_pos_BS), c),
    }
    optional = {
        "q_segment": q_segment_BT,
        "k_segment": k_segment_BS,
        "k_valid": k_valid_BS,
        "window": None if window is None else jnp.asarray(window, jnp.int32),
        "bias_params": bias_params,
        "dropout_key": dropout_key if dropout_rate > 0.0 else None,
    }
    for name, x in optional.items():
        if x is None:
            continue
        args[name] = x
        if name in ("window", "dropout_key"):
            specs[name] = P()
        elif name == "bias_params":
            specs[name] = P(*([None] * (x.ndim - 1)), h)
        else:
            specs[name] = P(rows(x), c)
    attend = ring_attention if method == "ring" else all_gather_attention
    extra = {} if method == "ring" else {"implementation": implementation}

    def local(a):
        k, v = a["k"], a["v"]
        if slice_kv:  # this shard's query heads all read kv head index // (shards / K)
            index = lax.axis_index(heads) // (shards // K)
            k, v = (lax.dynamic_slice_in_dim(x, index, 1, axis=2) for x in (k, v))
        local_bias = None
        if bias_fn is not None:
            # Varying over the ring here, so the table's gradient is summed over the
            # devices once, not at every block that reads it.
            params = _vary_like(a["bias_params"], like=a["q"])
            local_bias = functools.partial(bias_fn, params)
        key = a.get("dropout_key")
        if key is not None and batch + heads:
            key = jax.random.fold_in(key, lax.axis_index(batch + heads))
        return attend(
            a["q"],
            k,
            v,
            q_pos_BT=a["q_pos"],
            k_pos_BS=a["k_pos"],
            causal=causal,
            window=a.get("window"),
            q_segment_BT=a.get("q_segment"),
            k_segment_BS=a.get("k_segment"),
            k_valid_BS=a.get("k_valid"),
            bias_fn=local_bias,
            scale=scale,
            axis_name=axis_name,
            load_balance=load_balance,
            dropout_rate=dropout_rate,
            dropout_key=key,
            **extra,
        )

    return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=specs["q"])(args)


def zigzag(tree, *, mesh, inverse=False, axis_name="context", batch_axes=("data", "fsdp")):
    """Arrays ``[B|1, T, ...]`` moved between the contiguous and the zigzag layout over
    ``axis_name`` (``inverse``: back to contiguous); global arrays, ``shard_map`` inside.
    Equals ``x[:, zigzag_indices(T, C)]`` (and its inverse), moving half a chunk per
    device twice instead of gathering the sequence."""
    C = mesh.shape[axis_name]
    move = from_zigzag if inverse else to_zigzag

    def one(x):
        if x is None:
            return None
        if x.shape[1] % (2 * C):
            raise ValueError(f"zigzag: T={x.shape[1]} must be a multiple of 2 x {C} devices")
        batch = _fit(mesh, batch_axes, x.shape[0], taken=(axis_name,)) if x.shape[0] > 1 else ()
        spec = P(_spec_axes(batch), axis_name, *([None] * (x.ndim - 2)))
        return jax.shard_map(
            functools.partial(move, axis_name=axis_name), mesh=mesh, in_specs=spec, out_specs=spec
        )(x)

    return jax.tree.map(one, tree)
