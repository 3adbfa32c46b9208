"""Context parallelism: self-attention over a sequence split across devices along T.

With C devices on the mesh's ``context`` axis, each holds T/C queries and the keys and
values of the same T/C tokens. Two ways to attend, both pure functions called inside
``jax.shard_map`` over that axis (``context_parallel_attention`` does the ``shard_map``):

* ``ring_attention`` (``attnlab.ops.ring``): each device keeps its queries and passes its
  key/value chunk round the ring (``lax.ppermute`` to the next device, C - 1 times), with
  the chunk's positions, segment ids and validity. Each visit updates an online softmax
  in at least float32 (running max, normaliser and unnormalised output; float64 for
  float64 inputs), so no device ever holds more than two chunks of keys. The transfer of
  the next chunk does not depend on the work on the current one, so XLA can overlap them.
* ``all_gather_attention``: each device gathers every key and value (``lax.all_gather``)
  and attends its queries over all of them in one dense call (``dot_product_attention``,
  any implementation): one collective instead of C - 1, but the whole K/V and a ``[T/C,
  T]`` score matrix per device.

Masks are never ``[T, S]`` arrays: ``chunk_mask`` evaluates causal, sliding-window,
segment (packed documents) and key-validity rules for one (query chunk, key chunk) pair
from the chunks' positions, and a position bias (ALiBi, T5 relative) is a function of the
positions, ``bias_fn(q_pos_BT, k_pos_BS)``, evaluated per pair too. So is a score function,
``score_mod(score, b, h, q_idx, kv_idx)`` (``attnlab.ops.score_mods``, as
``dot_product_attention`` takes it), with ``q_idx``/``kv_idx`` the tokens' true indices
(their positions unless others are given) and, through ``context_parallel_attention``,
``b``/``h`` the global batch row and query head; the arrays it closes over are replicated
on every device, and values and gradients (to q, k, v and those arrays) are the dense
path's. Because every rule reads positions rather than array indices, the functions do
not care how tokens are laid out over the devices. A query row whose keys are all masked
gives zeros (finite gradients), as ``dot_product_attention`` does. K/V keep their K heads
(GQA/MQA): queries are grouped ``[.., K, G, ..]``, never K/V repeated.

Load balancing. Under a causal mask the device holding the last chunk of a contiguous
split attends to everything and the first to almost nothing, and a ring moves at the pace
of its slowest device. The zigzag layout splits the sequence into 2C chunks and gives
device i chunks i and 2C-1-i (``zigzag_indices``): then at every ring step after the
first, each device has exactly two of its four (query half, key half) blocks to compute,
and ``ring_attention`` (``load_balance``) skips the other two (``lax.cond`` on whether the
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

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from attnlab.ops import score_mods
from attnlab.ops.attention import dot_product_attention
from attnlab.ops.linear import fold
from attnlab.ops.precision import wide
from attnlab.ops.ring import ring_attention
from attnlab.ops.shard_scores import block_indices, trace, vary_floats
from attnlab.ops.shards import Rules, chunk_mask, full_meta, meta_mask, prepare, vary_like
from attnlab.ops.shards import fit_axes as _fit
from attnlab.ops.shards import spec_axes as _spec_axes

__all__ = [
    "METHODS",
    "all_gather_attention",
    "chunk_mask",
    "context_parallel_attention",
    "from_zigzag",
    "ring_attention",
    "to_zigzag",
    "zigzag",
    "zigzag_indices",
]

METHODS = ("ring", "all_gather")


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


def all_gather_attention(
    q_BTNH, k_BSKH, v_BSKH, q_meta, k_meta, rules: Rules, implementation="reference"
):
    """This device's queries over every device's keys, gathered (``lax.all_gather``);
    inside ``shard_map`` over ``rules.axis_name``. The arguments are those of
    ``ring_attention`` (``rules.load_balance`` changes nothing: the work is the same on
    every device), plus the ``dot_product_attention`` implementation; with a
    ``score_mod``, the reference one, the function applied to the ``[T/C, S]`` logits at
    once (``logits_fn``: its index arrays are those of one ring block)."""
    (_, T, _, _, K, G), scale = prepare(q_BTNH, k_BSKH, v_BSKH, rules.scale)

    def gather(x):
        return lax.all_gather(x, rules.axis_name, axis=1, tiled=True)

    q_meta = full_meta(q_meta, T, rules.score_mod)
    all_meta = jax.tree.map(gather, full_meta(k_meta, k_BSKH.shape[1], rules.score_mod))
    logits_fn = None
    if rules.score_mod is not None:  # called with the tokens' indices, wherever they lie
        idx = block_indices(q_BTNH.shape[0], K, G, q_meta, all_meta)
        logits_fn = lambda s_BKGTS: score_mods.apply(rules.score_mod, s_BKGTS, *idx)
        implementation = "reference"
    bias_fn = rules.bias_fn
    return dot_product_attention(
        q_BTNH,
        gather(k_BSKH),
        gather(v_BSKH),
        mask=meta_mask(q_meta, all_meta, rules.causal, rules.window),
        bias=None if bias_fn is None else bias_fn(q_meta["pos"], all_meta["pos"]),
        logits_fn=logits_fn,
        scale=scale,
        implementation=implementation,
        dropout_rate=rules.dropout_rate,
        dropout_key=fold(rules.dropout_key, lax.axis_index(rules.axis_name)),
    )


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
    score_mod: Callable | None = None,
    softcap: float | None = None,
    q_index_BT=None,
    k_index_BS=None,
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

    ``score_mod(score, b, h, q_idx, kv_idx)`` sees global arrays' indices: ``b`` the batch
    row, ``h`` the query head (each shard's offset added), ``q_idx``/``kv_idx`` the tokens'
    ``q_index_BT``/``k_index_BS`` (default: the positions), so it may index the global
    arrays it closes over (each device holds them whole). ``softcap`` caps the biased
    logits at ``c * tanh(s / c)`` before it.
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
    if softcap is not None:
        score_mod = score_mods.compose(score_mods.softcap(float(softcap)), score_mod)
    args = {"q": q_BTNH, "k": k_BSKH, "v": v_BSKH}
    specs = {
        "q": P(b, c, h, None),
        "k": P(b, c, None if slice_kv else h, None),
        "v": P(b, c, None if slice_kv else h, None),
    }
    if score_mod is None:  # the tokens' indices are only a score function's
        q_index_BT = k_index_BS = None
    metas = {  # the chunks' metadata (attnlab.ops.shards)
        "q_meta": {"pos": q_pos_BT, "segment": q_segment_BT, "index": q_index_BT},
        "k_meta": {
            "pos": k_pos_BS,
            "segment": k_segment_BS,
            "valid": k_valid_BS,
            "index": k_index_BS,
        },
    }
    for side, meta in metas.items():
        args[side] = {k: x for k, x in meta.items() if x is not None}
        specs[side] = {k: P(rows(x), c) for k, x in args[side].items()}
    optional = {
        "window": None if window is None else jnp.asarray(window, jnp.int32),
        "bias_params": bias_params,
        "dropout_key": dropout_key if dropout_rate > 0.0 else None,
    }
    for name, x in optional.items():
        if x is not None:
            args[name] = x
            specs[name] = P(*([None] * (x.ndim - 1)), h) if name == "bias_params" else P()
    mod = None
    if score_mod is not None:  # traced here: its arrays enter shard_map as inputs
        n = 2 if method == "ring" and load_balance else 1
        q_idx = q_pos_BT if q_index_BT is None else q_index_BT
        k_idx = k_pos_BS if k_index_BS is None else k_index_BS
        shards_of = lambda axes: math.prod(mesh.shape[a] for a in axes)
        local = (B // shards_of(batch), T // C, N // shards, 1 if slice_kv else K // shards)
        example = _score_example(*local, n, method == "ring", q_idx, k_idx, wide(q_BTNH, k_BSKH))
        mod, args["mod_args"] = trace(score_mod, example)
        specs["mod_args"] = tuple(P() for _ in args["mod_args"])  # whole on every device
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
            params = vary_like(a["bias_params"], like=a["q"])
            local_bias = functools.partial(bias_fn, params)
        local_mod = None
        if mod is not None:  # this shard's rows and heads at their global indices
            b0 = lax.axis_index(batch) * a["q"].shape[0] if batch else 0
            h0 = lax.axis_index(heads) * a["q"].shape[2] if heads else 0
            mod_args = vary_floats(a["mod_args"], like=a["q"])  # one psum of their gradient
            local_mod = lambda s, b, h, q, k: mod(s, b + b0, h + h0, q, k, *mod_args)
        key = a.get("dropout_key")
        if key is not None and batch + heads:
            key = jax.random.fold_in(key, lax.axis_index(batch + heads))
        rules = Rules(
            causal=causal,
            window=a.get("window"),
            bias_fn=local_bias,
            score_mod=local_mod,
            scale=scale,
            axis_name=axis_name,
            load_balance=load_balance,
            dropout_rate=dropout_rate,
            dropout_key=key,
        )
        return attend(a["q"], k, v, a["q_meta"], a["k_meta"], rules, **extra)

    return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=specs["q"])(args)


def _score_example(B, T, N, K, n, ring, q_idx_BT, k_idx_BS, dtype):
    """A score function's arguments for one block of one device (``B`` rows, ``T``
    tokens, ``N`` query and ``K`` kv heads): a ring block of ``T/n`` queries and keys, or
    the all-gather's ``T`` queries over every key; the indices' rows as the arrays'."""
    t = T // n
    s = t if ring else q_idx_BT.shape[1]
    rows = lambda x: 1 if x.shape[0] == 1 else B
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    return (
        jnp.zeros((B, K, N // K, t, s), dtype),
        zeros(B, 1, 1, 1, 1),
        zeros(1, K, N // K, 1, 1),
        zeros(rows(q_idx_BT), 1, 1, t, 1),
        zeros(rows(k_idx_BS), 1, 1, 1, s),
    )


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
