"""Flex attention on a TPU, two ways:

* ``splash_attention`` (``supports_splash``): JAX's splash attention where it covers the
  call: no ``score_mod``, a ``MaskSpec`` of causal / sliding-window rules over aligned
  positions and segment ids (packed documents), a softcap (``attn_logits_soft_cap``), sinks,
  grouped heads (its grouped form: keys and values are not repeated), blocks that are
  multiples of 128 dividing T and S. Its block sparsity comes from its own static mask.
* ``flex_attention_tpu`` (``supports``): everything else (any ``score_mod`` whose
  closed-over arrays are read one entry per ``(b, h, q_idx, kv_idx)`` or at scalar indices,
  prefix-LM, ragged lengths, validity, dense masks): the streaming kernels of
  ``flex_tpu_kernels`` (grid ``(B, N, nq, steps)``, the visited key blocks innermost, block
  tables as scalar prefetch, ``O(block)`` memory per program).

With ``interpret=False`` both are built for a TPU whatever the host, so a CPU lowers them
for one (``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))``: Mosaic checks the
block tiling there; the chip's own compiler runs only on the chip). ``interpret=True`` runs
them in Pallas interpret mode on the CPU, which is how their values are tested.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.errors import ConfigError
from attnlab.ops.masks import MaskSpec
from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas import _flex_grads, _flex_kernels
from attnlab.ops.pallas import flex_tpu_kernels as tk_
from attnlab.ops.pallas import flex_tpu_mods as mods

SPLASH_BLOCK = 128
_FALLBACK = "falling back to pallas_tpu"
_F32 = jnp.float32
MIN_ROWS = 8  # a query block's rows on the chip: one vreg's sublanes


def default_blocks(T, S):
    """``(block_q, block_k)``: 128 up to 8192 tokens, 256 beyond. As in JAX's flash attention,
    128 fills the MXU and keeps each program's ``[tq, tk]`` float32 intermediates (logits,
    weights, their cotangents: a few hundred KiB) well inside scoped VMEM; longer sequences
    take 256 to halve the grid steps (each costs ~0.35 us of pipeline overhead) and to keep
    the block tables, which live in SMEM as ``nq * steps`` int32, at <= 16K entries for 32K
    tokens. Blocks are capped at T and S (a block spanning a whole axis always tiles)."""
    block = 128 if max(T, S) <= 8192 else 256
    return block, block


def supports(q_BTNH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, sinks=None, softcap=None,
             block_q=None, block_k=None, block_mask=None, interpret=False, **_):  # fmt: skip
    """None when the Mosaic-TPU flex kernel takes the call, else one line naming the argument.

    With ``interpret=False`` the kernel is built for a TPU whatever the host (a CPU can lower
    it for one); ``interpret=True`` runs it in Pallas interpret mode."""
    if (reason := cm.check_common(q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask,
                                  sinks=sinks, softcap=softcap)) is not None:  # fmt: skip
        return f"{reason}; falling back to chunked"
    if isinstance(mask, MaskSpec) and getattr(mask, "allowed", None) is not None:
        return "mask.allowed: the Mosaic-TPU flex kernel has no such rule; falling back to chunked"
    if block_mask is not None:
        block_q, block_k = block_mask.block_q, block_mask.block_k
    for name, value, least in (("block_q", block_q, 8), ("block_k", block_k, 128)):
        if value is not None and not (isinstance(value, int) and value >= 1):
            return f"{name}={value!r}: must be a positive integer; falling back to chunked"
        if not interpret and value is not None and value % least:
            return (
                f"{name}={value}: Mosaic TPU blocks are multiples of {least}; "
                "falling back to chunked"
            )
    if not interpret and score_mod is not None:
        T, S = q_BTNH.shape[1], k_BSKH.shape[1]
        bq, bk = default_blocks(T, S)
        tq, tk = min(block_q or bq, T), min(block_k or bk, S)
        B, N = q_BTNH.shape[0], q_BTNH.shape[2]
        try:
            sm = cm.convert_score_mod(score_mod, tq, tk)
            plan = mods.plan_score_mod(sm, B=B, N=N, tq=tq, tk=tk, T_pad=mods.ceil_to(T, tq),
                                       S_pad=mods.ceil_to(S, tk))  # fmt: skip
            missing = mods.mosaic_unlowerable(sm, plan, tq, tk)
        except ConfigError as e:
            return f"{e}; falling back to chunked"
        except Exception as e:  # a score_mod the kernel's reader cannot follow
            line = str(e).splitlines()[0] if str(e) else type(e).__name__
            return f"score_mod: cannot be read per block ({line}); falling back to chunked"
        if plan.unsupported():
            return (
                "score_mod: reads a closed-over array other than one entry at "
                "(b, h, q_idx, kv_idx) or at scalar indices (e.g. a gather of rows), which "
                "Mosaic TPU cannot load per block; falling back to chunked"
            )
        if missing:
            return (
                f"score_mod: uses {', '.join(missing)}, which the Mosaic TPU lowering lacks; "
                "falling back to chunked"
            )
    return None


def flex_attention_tpu(q_BTNH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, block_mask=None,
                       scale=None, sinks=None, softcap=None, block_q=None, block_k=None,
                       interpret: bool = False):  # fmt: skip
    """Flex attention through the streaming Mosaic-TPU kernels (``flex_tpu_kernels``):
    ``out_BTNH``, with ``flex_gpu``'s meaning. ``mask``: None, a ``MaskSpec`` or a dense
    bool ``[B|1, N|1, T, S]``; ``block_mask`` its ``BlockMask`` (else built here); blocks
    default to ``default_blocks``. Differentiable in q, k, v, sinks and the float arrays
    ``score_mod`` closes over."""
    kw = dict(score_mod=score_mod, mask=mask, block_mask=block_mask, sinks=sinks,
              softcap=softcap, block_q=block_q, block_k=block_k, interpret=interpret)  # fmt: skip
    if (reason := supports(q_BTNH, k_BSKH, v_BSKH, **kw)) is not None:
        raise ConfigError(reason)
    T = q_BTNH.shape[1]
    if T < MIN_ROWS and block_mask is None:  # decoding: a block of 8 sublanes
        q_BTNH, kw["mask"] = _pad_queries(q_BTNH, mask, k_BSKH.shape[1])
        return _attention(q_BTNH, k_BSKH, v_BSKH, scale=scale, **kw)[:, :T]
    return _attention(q_BTNH, k_BSKH, v_BSKH, scale=scale, **kw)


def _pad_queries(q, mask, S):
    """``q`` and ``mask`` over ``MIN_ROWS`` queries: the added rows repeat the last one's
    positions (a dense mask's are masked); their outputs are dropped."""
    q = cm.pad_to(q, 1, MIN_ROWS)
    if isinstance(mask, MaskSpec):
        mask = mask.padded(MIN_ROWS, S)
    elif mask is not None:
        m = jnp.asarray(mask, bool)
        mask = jnp.pad(m, [(0, 0), (0, 0), (0, MIN_ROWS - m.shape[2]), (0, 0)])
    return q, mask


def _visit_tables(bm, transpose, bound=None):
    """``((index, count, partial), steps)``: per row the blocks visited, PARTIAL then FULL,
    the index repeating the last visited block past the count (no new copy), flattened.
    ``steps`` is the longest row when the tables are known while tracing, else ``bound``
    (a static bound on every row's count), else every block."""
    po, pc, fo, fc = cm.split_tables(bm, transpose=transpose)
    n = po.shape[1]
    t_ = jnp.arange(n, dtype=jnp.int32)[None, :]
    full = jnp.take_along_axis(fo, jnp.clip(t_ - pc[:, None], 0, n - 1), 1)
    order = jnp.where(t_ < pc[:, None], po, full)
    count = pc + fc
    last = jnp.clip(jnp.minimum(t_, count[:, None] - 1), 0, n - 1)
    index = jnp.take_along_axis(order, last, 1)
    try:  # tables known while tracing: as many steps as the longest row (sliced on the
        # host: inside a shard_map a concrete array's slicing asks for a mesh sharding)
        steps = max(int(jax.device_get(count.max())), 1)
        index = np.asarray(jax.device_get(index))
    except (jax.errors.ConcretizationTypeError, TypeError):
        steps = n if bound is None else min(bound, n)
    return (index[:, :steps].reshape(-1), count, pc), steps


def _window_bounds(mask, bm):
    """Static bounds on the blocks a query block (a key block) visits under a static window
    over aligned positions, whose block tables may be traced (a MaskSpec built inside jit):
    query rows ``[qs, qs + tq)`` reach keys ``(qs - w, qs + tq)``, ``w + tq - 1`` of them,
    so at most ``ceil((w + tq - 1) / tk) + 1`` key blocks (every other rule only removes
    keys). Without them the grid walks every block of a row, most of them idle."""
    window = getattr(mask, "window", None)
    if not (isinstance(mask, MaskSpec) and mask.aligned and isinstance(window, int)):
        return None, None
    tq, tk = bm.block_q, bm.block_k
    return -(-(window + tq - 1) // tk) + 1, -(-(window + tk - 1) // tq) + 1


def _attention(q, k, v, *, score_mod, mask, block_mask, scale, sinks, softcap, block_q,
               block_k, interpret):  # fmt: skip
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    bq, bk = default_blocks(T, S)
    with cm.eager():
        bm = cm.resolve_block_mask(mask, block_mask, T, S, block_q or bq, block_k or bk)
        bound_q, bound_k = _window_bounds(mask, bm)
        tables_q, steps_q = _visit_tables(bm, False, bound_q)
        tables_k, steps_k = _visit_tables(bm, True, bound_k)
    tq, tk = bm.block_q, bm.block_k
    nq, nk = bm.shape
    T_pad, S_pad = nq * tq, nk * tk
    sm = cm.convert_score_mod(score_mod, tq, tk)
    plan = None
    if sm is not None:
        plan = mods.plan_score_mod(sm, B=B, N=N, tq=tq, tk=tk, T_pad=T_pad, S_pad=S_pad)
    consts = () if sm is None else sm.consts
    wants = () if sm is None else sm.float_consts
    mi = cm.mask_inputs(mask, B, T, S, T_pad, S_pad)
    stream_sizes = ()
    if plan is not None:
        stream_sizes = tuple(
            tuple(consts[st.const].shape[a] for a in st.perm if st.roles[a] in "bh")
            for st in plan.streams
        )
    c = tk_.Config(
        B=B, T=T, S=S, N=N, K=K, H=H, tq=tq, tk=tk, nq=nq, nk=nk, steps_q=steps_q,
        steps_k=steps_k, scale=cm.default_scale(scale, H),
        softcap=None if softcap is None else float(softcap),
        mod=None if sm is None else mods.score_fn(sm, plan), plan=plan,
        stream_sizes=stream_sizes, spec=(mi.causal, mi.names) if mi.kind == "spec" else None,
        mask_names=mi.names,
        dense_shape=tuple(mi.arrays[0].shape[:2]) if mi.kind == "dense" else (),
        has_sinks=sinks is not None, interpret=interpret,
    )  # fmt: skip

    def streams(consts):
        if plan is None:
            return ()
        return tuple(mods.stream_array(st, consts[st.const], T_pad, S_pad) for st in plan.streams)

    def bnth(x, size):
        return cm.pad_to(x, 1, size).transpose(0, 2, 1, 3)

    # The block tables and the mask's arrays (traced, inside a scan or jit) are inputs of
    # the custom VJP, never closed over, so they cannot leak out of its backward pass.
    def unpack(aux):
        tq_, tk_tables, split, masks = aux[:3], aux[3:6], aux[6:10], aux[10:]
        kernel_masks = masks
        if mi.kind == "dense" and tq % 32:  # int8 tiles are (32, 128)
            kernel_masks = (masks[0].astype(jnp.int32),)
        return tq_, tk_tables, split, masks, kernel_masks

    def run_fwd(q, k, v, sinks, consts, aux):
        tables_q, _, _, _, kernel_masks = unpack(aux)
        out, lse = tk_.forward(c, tables_q, bnth(q, T_pad), bnth(k, S_pad), bnth(v, S_pad),
                               sinks, kernel_masks, consts, streams(consts))  # fmt: skip
        return out.transpose(0, 2, 1, 3)[:, :T], lse

    @jax.custom_vjp
    def f(q, k, v, sinks, consts, aux):
        return run_fwd(q, k, v, sinks, consts, aux)[0]

    def f_fwd(q, k, v, sinks, consts, aux):
        out, lse = run_fwd(q, k, v, sinks, consts, aux)
        return out, (q, k, v, sinks, consts, aux, out, lse)

    def f_bwd(res, do):
        q, k, v, sinks, consts, aux, out, lse = res
        tables_q, tables_k, split, masks, kernel_masks = unpack(aux)
        delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(_F32), out.astype(_F32))
        delta = cm.pad_to(delta, 2, T_pad)
        delta_l = jnp.broadcast_to(delta[..., None], lse.shape)
        dq, dk, dv = tk_.backward(
            c, tables_q, tables_k, bnth(q, T_pad), bnth(k, S_pad), bnth(v, S_pad),
            bnth(do.astype(q.dtype), T_pad), lse, delta_l, kernel_masks, consts, streams(consts),
        )  # fmt: skip
        dq = dq.transpose(0, 2, 1, 3)[:, :T]
        dk, dv = (x.transpose(0, 2, 1, 3)[:, :S] for x in (dk, dv))
        lse0 = lse[..., 0]
        dsinks = None
        if sinks is not None:  # d out / d sink = -p_sink * out
            p_sink = jnp.exp(sinks.astype(_F32)[None, :, None] - lse0)
            dsinks = -(p_sink * delta).sum((0, 2)).astype(sinks.dtype)
        dconsts = tuple(None for _ in consts)
        if any(wants):  # the GPU kernels' blockwise pass in plain JAX over the same visits
            gc = _flex_kernels.Config(
                B=B, T=T, S=S, N=N, K=K, H=H, tq=tq, tk=tk, nq=nq, nk=nk, scale=c.scale,
                softcap=c.softcap, mod=sm.fn, mod_refs=None,
                const_shapes=tuple(x.shape for x in consts), mask_kind=mi.kind,
                mask_names=mi.names, causal=mi.causal, dense_shape=c.dense_shape,
                has_sinks=sinks is not None, layout="BTNH", prefetch=False, interpret=True,
            )  # fmt: skip
            dconsts = tuple(_flex_grads.const_grads(
                gc, split, cm.pad_to(q, 1, T_pad), cm.pad_to(k, 1, S_pad), cm.pad_to(v, 1, S_pad),
                cm.pad_to(do, 1, T_pad), lse0, delta, masks, consts, wants,
            ))  # fmt: skip
        return dq, dk, dv, dsinks, dconsts, tuple(None for _ in aux)

    f.defvjp(f_fwd, f_bwd)
    sinks_arr = None if sinks is None else jnp.asarray(sinks)
    aux = (*tables_q, *tables_k, *cm.split_tables(bm), *mi.arrays)
    return f(q, k, v, sinks_arr, tuple(consts), aux)


# ------------------------------------------------------------------------------------------
# Splash attention
# ------------------------------------------------------------------------------------------


def _splash():
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


def _splash_takes_sinks():
    kernel = _splash().splash_attention_kernel
    return "sinks" in inspect.signature(kernel._splash_attention).parameters


def supports_splash(q_BTNH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, sinks=None,
                    softcap=None, block_q=None, block_k=None, block_mask=None,
                    interpret=False, **_):  # fmt: skip
    """None when splash attention covers the call, else one line naming the argument and
    the fallback (the Mosaic-TPU flex kernel)."""
    if (reason := cm.check_common(q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask,
                                  sinks=sinks, softcap=softcap)) is not None:  # fmt: skip
        return f"{reason}; falling back to chunked"
    if score_mod is not None:
        return f"score_mod: splash attention takes no score_mod; {_FALLBACK}"
    if block_mask is not None:
        return f"block_mask: splash attention builds its own from the mask; {_FALLBACK}"
    if mask is not None and not isinstance(mask, MaskSpec):
        return f"mask: splash attention takes a MaskSpec, not a dense mask; {_FALLBACK}"
    if isinstance(mask, MaskSpec):
        for name in ("prefix_length", "k_length", "k_valid", "q_valid"):
            if getattr(mask, name) is not None:
                return f"mask.{name}: splash attention has no such rule; {_FALLBACK}"
        reason = cm.fixed_rules_reason(mask, "splash's", "splash's mask is static", _FALLBACK)
        if reason is not None:
            return reason
    if sinks is not None and not _splash_takes_sinks():
        return f"sinks: this jax's splash attention takes no sinks; {_FALLBACK}"
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    for name, value, length in (("block_q", block_q, T), ("block_k", block_k, S)):
        size = min(SPLASH_BLOCK if value is None else value, length)
        if size % SPLASH_BLOCK or length % size:
            return (
                f"{name}={size}: splash blocks are multiples of {SPLASH_BLOCK} dividing the "
                f"length {length}; {_FALLBACK}"
            )
    return None


def splash_attention(q_BTNH, k_BSKH, v_BSKH, *, mask=None, scale=None, sinks=None,
                     softcap=None, block_q=None, block_k=None, interpret: bool = False,
                     **kwargs):  # fmt: skip
    """Splash attention for the calls ``supports_splash`` accepts: ``out_BTNH``.

    A query of segment 0 (padding) gets a zero output, as the MaskSpec says; splash sees
    its segment as -1 against keys' -2, so no pair of padding tokens attends.
    """
    kw = dict(mask=mask, sinks=sinks, softcap=softcap, block_q=block_q, block_k=block_k,
              interpret=interpret, **kwargs)  # fmt: skip
    if (reason := supports_splash(q_BTNH, k_BSKH, v_BSKH, **kw)) is not None:
        raise ConfigError(reason)
    sa = _splash()
    B, T, N, H = q_BTNH.shape
    S = k_BSKH.shape[1]
    bq = min(SPLASH_BLOCK if block_q is None else block_q, T)
    bk = min(SPLASH_BLOCK if block_k is None else block_k, S)
    base = sa.FullMask((T, S))
    segments = None
    if isinstance(mask, MaskSpec):
        if mask.window is not None:
            base = sa.LocalMask((T, S), (int(mask.window) - 1, 0), 0)
        elif mask.causal:
            base = sa.CausalMask((T, S))
        if mask.q_segment is not None:
            q_seg = jnp.broadcast_to(mask.q_segment, (B, T)).astype(jnp.int32)
            k_seg = jnp.broadcast_to(mask.k_segment, (B, S)).astype(jnp.int32)
            segments = (q_seg, k_seg)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                          block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq,
                          block_kv_dq=bk)  # fmt: skip
    kernel = sa.make_splash_mha(
        sa.MultiHeadMask([base] * N),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=None if softcap is None else float(softcap),
        interpret=interpret,
    )
    scale = cm.default_scale(scale, H)
    q = (q_BTNH * jnp.asarray(scale, q_BTNH.dtype)).transpose(0, 2, 1, 3)
    k, v = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    if segments is None:
        out = jax.vmap(lambda q, k, v: kernel(q, k, v, sinks=sinks))(q, k, v)
    else:
        q_seg, k_seg = segments
        ids = sa.SegmentIds(jnp.where(q_seg > 0, q_seg, -1), jnp.where(k_seg > 0, k_seg, -2))
        out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids, sinks=sinks))(
            q, k, v, ids
        )
    out = out.transpose(0, 2, 1, 3)
    if segments is not None:
        out = jnp.where((segments[0] > 0)[:, :, None, None], out, 0)
    return out.astype(q_BTNH.dtype)
