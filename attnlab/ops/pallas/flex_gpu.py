"""Flex attention as Pallas kernels in the Triton style: forward and backward, block-sparse.

``out = softmax(score_mod(softcap(scale * q.k)), masked, with sinks) v``, the meaning of
``attnlab.ops.flex``. Three kernels, each over a grid of programs:

* forward, grid ``(B, N, nq)``: one query block against the key blocks of its row of the
  ``BlockMask`` (PARTIAL ones with the mask evaluated, then FULL ones without), online
  softmax in float32, writing the output and the log-sum-exp (sinks included);
* dQ, grid ``(B, N, nq)``: the same visits, recomputing the weights from the saved
  log-sum-exp; the ``score_mod``'s derivative is ``jax.vjp`` of it on the block;
* dK/dV, grid ``(B, K, nk)``: one key block against the query blocks of its column, summing
  over the ``G`` query heads that read the kv head (keys and values are never repeated).

Inside the kernels the arrays a ``score_mod`` closes over stay in memory: indexing one entry
at a time (``slopes[h]``, ``gate[b, h, q_idx]``) becomes a ref load (``_refmod``), which the
Triton lowering takes where a gather on a value it does not; ``supports`` names a
``score_mod`` that would still need one.

Gradients of the arrays a ``score_mod`` closes over (hoisted into explicit inputs) come from
one more blockwise pass in plain JAX over the same non-empty blocks (``_flex_grads``): it
recomputes the block's logits and ``dP`` (two block matmuls per visited block against the
kernels' seven: about 30% more backward matmul work, unfused) and applies the
``score_mod``'s vjp with respect to the arrays; it runs only when the ``score_mod`` closes
over float arrays. Its memory is one ``[B, N, tq, tk]`` block and the arrays' gradients,
never ``[T, S]``. (Per-program partial sums written by the dQ kernel would cost
``B N nq`` copies of every array: fine for per-head slopes, quadratic for a ``[B, N, T]``
gate.) Sink gradients come from the log-sum-exp in ``O(B N T)``.

``T`` and ``S`` need not divide the blocks: inputs are zero-padded and padded keys masked.
A query row with no allowed key gets a zero output and zero gradients. ``flex_tpu`` runs the
same kernels with Mosaic-TPU block shapes (``layout="BNTH"``, tables as scalar prefetch).

On a GPU the kernels go through Pallas's Triton lowering, chosen explicitly: every call
passes Triton ``CompilerParams`` (``_flex_calls``), since a plain ``pallas_call`` goes to
Mosaic GPU. Under Triton a whole-array BlockSpec is only a pointer and each
``ref[pl.ds(ks, tk)]`` loads one tile, so a program holds O(block) data and the kernels
stream keys and values flash-style. Mosaic GPU copies each BlockSpec's block into shared
memory (a whole head's keys and values: more than an H100's 227 KiB at ``T = 1024``,
``H = 128``) and needs a warpgroup/TMA design with static pipelining, which cannot express
data-dependent block visits, arbitrary ``score_mod`` jaxprs or ref-indexed gathers.
``supports`` never looks at the host's backend: with ``interpret=False`` the kernels are
built for the GPU, so a program lowers for CUDA on any machine.

The module holds the entry point; ``_flex_kernels`` the program bodies and ``Config``,
``_flex_calls`` the BlockSpecs and calls, ``_flex_grads`` the arrays' gradient pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.errors import ConfigError
from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas import _refmod
from attnlab.ops.pallas._flex_calls import backward, forward
from attnlab.ops.pallas._flex_grads import const_grads
from attnlab.ops.pallas._flex_kernels import Config

__all__ = ["DEFAULT_BLOCK", "Config", "attention", "flex_attention_gpu", "supports",
           "visited_blocks"]  # fmt: skip

_F32 = jnp.float32

# ------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------

DEFAULT_BLOCK = 64


def supports(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    score_mod=None,
    mask=None,
    block_mask=None,
    scale=None,
    sinks=None,
    softcap=None,
    block_q=None,
    block_k=None,
    interpret=False,
    **_,
) -> str | None:
    """None when the kernel takes the call, else one line naming the argument."""
    if (reason := cm.check_common(q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask,
                                  sinks=sinks, softcap=softcap)) is not None:  # fmt: skip
        return f"{reason}; falling back to chunked"
    if block_mask is not None:
        block_q, block_k = block_mask.block_q, block_mask.block_k
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and not (isinstance(value, int) and value >= 1):
            return f"{name}={value!r}: must be a positive integer; falling back to chunked"
        if not interpret and value is not None and not cm.is_pow2(value, 16):
            return (
                f"{name}={value}: the Triton kernel takes powers of two >= 16; "
                "falling back to chunked"
            )
    if not interpret and score_mod is not None:
        missing = cm.triton_unlowerable(score_mod)
        if missing:
            return (
                f"score_mod: uses {', '.join(missing)}, which the Pallas Triton lowering "
                "lacks (closed-over arrays lower when indexed one entry at a time); "
                "falling back to chunked"
            )
    H = q_BTNH.shape[-1]
    if not interpret and not cm.is_pow2(H, 16):
        return (
            f"q_BTNH: head dim H={H} is not a power of two >= 16 (Triton tiles); "
            "falling back to chunked"
        )
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    for name, length, value in (("T", T, block_q), ("S", S, block_k)):
        block = min(DEFAULT_BLOCK if value is None else value, length)  # a block is <= the length
        if not interpret and not cm.is_pow2(block, 16):
            return (
                f"{name}={length}: shorter than the block, so the block is {block}, not a "
                "power of two >= 16 (Triton tiles); falling back to chunked"
            )
    return None


def _config(
    q,
    k,
    *,
    mod,
    mod_refs,
    consts,
    mi,
    bm,
    scale,
    softcap,
    sinks,
    layout,
    prefetch,
    interpret,
    count,
):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    nq, nk = bm.shape
    dense_shape = mi.arrays[0].shape[:2] if mi.kind == "dense" else ()
    return Config(
        B=B, T=T, S=S, N=N, K=K, H=H, tq=bm.block_q, tk=bm.block_k, nq=nq, nk=nk,
        scale=cm.default_scale(scale, H), softcap=None if softcap is None else float(softcap),
        mod=mod, mod_refs=mod_refs, const_shapes=tuple(x.shape for x in consts), mask_kind=mi.kind,
        mask_names=mi.names, causal=mi.causal, dense_shape=tuple(dense_shape),
        has_sinks=sinks is not None, layout=layout, prefetch=prefetch, interpret=interpret,
        count=count,
    )  # fmt: skip


def _prepare(q, k, v, score_mod, mask, block_mask, block_q, block_k, reason_fn, kwargs):
    if (reason := reason_fn(q, k, v, **kwargs)) is not None:
        raise ConfigError(reason)
    B, T, N, H = q.shape
    S = k.shape[1]
    bq = DEFAULT_BLOCK if block_q is None else block_q
    bk = DEFAULT_BLOCK if block_k is None else block_k
    bm = cm.resolve_block_mask(mask, block_mask, T, S, bq, bk)
    sm = cm.convert_score_mod(score_mod, bm.block_q, bm.block_k)
    mi = cm.mask_inputs(mask, B, T, S, bm.T_pad, bm.S_pad)
    return bm, sm, mi


def attention(q, k, v, *, score_mod=None, mask=None, block_mask=None, scale=None, sinks=None,
              softcap=None, block_q=None, block_k=None, interpret=False, layout="BTNH",
              prefetch=False, count=False, reason_fn=None):  # fmt: skip
    """The kernels' shared entry: ``(out_BTNH, counts)``; see ``flex_attention_gpu``."""
    kw = dict(score_mod=score_mod, mask=mask, block_mask=block_mask, scale=scale, sinks=sinks,
              softcap=softcap, block_q=block_q, block_k=block_k, interpret=interpret)  # fmt: skip
    bm, sm, mi = _prepare(q, k, v, score_mod, mask, block_mask, block_q, block_k,
                          reason_fn or supports, kw)  # fmt: skip
    consts = () if sm is None else sm.consts
    wants = () if sm is None else sm.float_consts
    mod_refs = None if sm is None else _refmod.ref_score_fn(sm)
    c = _config(q, k, mod=None if sm is None else sm.fn, mod_refs=mod_refs, consts=consts,
                mi=mi, bm=bm,
                scale=scale, softcap=softcap, sinks=sinks, layout=layout, prefetch=prefetch,
                interpret=interpret, count=count)  # fmt: skip
    tables_q, tables_k = cm.split_tables(bm), cm.split_tables(bm, transpose=True)

    def to_layout(x, size):  # BTNH padded -> the kernel's layout
        x = cm.pad_to(x, 1, size)
        return x.transpose(0, 2, 1, 3) if layout == "BNTH" else x

    def from_layout(x, size):
        x = x.transpose(0, 2, 1, 3) if layout == "BNTH" else x
        return x[:, :size]

    # The block tables and mask arrays are arguments of the custom-vjp function, never its
    # closure: traced inside a layer scan, a closed-over tracer would leak out of the
    # backward pass.
    aux = (tables_q, tables_k, tuple(mi.arrays))

    def run_fwd(q, k, v, sinks, consts, aux):
        tables_q, _, arrays = aux
        out, lse, cnt = forward(c, tables_q, to_layout(q, c.T_pad), to_layout(k, c.S_pad),
                                 to_layout(v, c.S_pad), sinks, arrays, consts)  # fmt: skip
        return from_layout(out, c.T), lse, cnt

    sinks_arr = None if sinks is None else jnp.asarray(sinks)
    if count:  # forward only, with the visit counters
        out, _, cnt = run_fwd(q, k, v, sinks_arr, tuple(consts), aux)
        return out, cnt

    @jax.custom_vjp
    def f(q, k, v, sinks, consts, aux):
        return run_fwd(q, k, v, sinks, consts, aux)[0]

    def f_fwd(q, k, v, sinks, consts, aux):
        out, lse, _ = run_fwd(q, k, v, sinks, consts, aux)
        return out, (q, k, v, sinks, consts, aux, out, lse)

    def f_bwd(res, do):
        q, k, v, sinks, consts, aux, out, lse = res
        tables_q, tables_k, arrays = aux
        delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(_F32), out.astype(_F32))
        delta = cm.pad_to(delta, 2, c.T_pad)
        qp, kp, vp, dop = (to_layout(x, n) for x, n in ((q, c.T_pad), (k, c.S_pad),
                                                         (v, c.S_pad), (do, c.T_pad)))  # fmt: skip
        dq, dk, dv = backward(c, tables_q, tables_k, qp, kp, vp, dop.astype(q.dtype), lse,
                               delta, arrays, consts)  # fmt: skip
        dq, dk, dv = from_layout(dq, c.T), from_layout(dk, c.S), from_layout(dv, c.S)
        dsinks = None
        if sinks is not None:  # d out / d sink = -p_sink * out
            p_sink = jnp.exp(sinks.astype(_F32)[None, :, None] - lse)
            dsinks = -(p_sink * delta).sum((0, 2)).astype(sinks.dtype)
        dconsts = tuple(None for _ in consts)
        if any(wants):
            dconsts = tuple(
                const_grads(
                    c,
                    tables_q,
                    cm.pad_to(q, 1, c.T_pad),
                    cm.pad_to(k, 1, c.S_pad),
                    cm.pad_to(v, 1, c.S_pad),
                    cm.pad_to(do, 1, c.T_pad),
                    lse,
                    delta,
                    arrays,
                    consts,
                    wants,
                )  # fmt: skip
            )
        return dq, dk, dv, dsinks, dconsts, jax.tree.map(lambda _: None, aux)

    f.defvjp(f_fwd, f_bwd)
    return f(q, k, v, sinks_arr, tuple(consts), aux), None


def flex_attention_gpu(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    score_mod=None,
    mask=None,
    block_mask=None,
    scale=None,
    sinks=None,
    softcap=None,
    block_q=None,
    block_k=None,
    interpret: bool = False,
):
    """Flex attention through the Pallas (Triton-style) kernels: ``out_BTNH``.

    ``mask``: None, a ``MaskSpec`` or a dense bool ``[B|1, N|1, T, S]``; ``block_mask``: its
    ``BlockMask`` (else built here, shared by forward and backward); blocks default to 64.
    Differentiable in q, k, v, sinks and the float arrays ``score_mod`` closes over.
    """
    out, _ = attention(
        q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask, block_mask=block_mask,
        scale=scale, sinks=sinks, softcap=softcap, block_q=block_q, block_k=block_k,
        interpret=interpret,
    )  # fmt: skip
    return out


def visited_blocks(q_BTNH, k_BSKH, v_BSKH, **kwargs):
    """``(out_BTNH, counts[B, N, nq, 2])``: the forward kernel with, per program, the number
    of key blocks it visited and how many of them evaluated the mask (the PARTIAL ones)."""
    return attention(q_BTNH, k_BSKH, v_BSKH, count=True, **kwargs)
