"""Decode attention as a Pallas kernel: one query row per batch row against its cache, split
over the cache length (flash decoding), forward only.

Grid ``(B, K, num_splits)``: a program takes the ``G`` query heads that read kv head ``kh``
(one ``[Gp, H]`` block, below, so grouped heads share each key block's load) and one split of the
cache, loops over that split's non-empty key blocks of its batch row (PARTIAL ones with the
mask evaluated, FULL ones without) and writes a partial softmax: the split's normalised
output and log-sum-exp. The splits are combined after the kernel, the sinks joining the
denominator there. The per-row tables come from the ``MaskSpec`` (cache length, window,
causal position), so a row with a short cache visits only its written blocks.

``score_mod(score, b, h, q_idx, kv_idx)`` gets ``q_idx`` = the query's position in the cache:
``mask.q_pos[b, 0]`` for a ``MaskSpec`` (``MaskSpec.for_cache(1, S, start_B)`` puts it at
``start_B[b]``), else ``S - 1``. The arrays it closes over stay in memory and are read as in
the flex kernels (``_refmod``): ``slopes[h]`` is one ref load, not a slice of a value.

On a GPU the call passes Triton ``CompilerParams`` (the Triton lowering, for the reasons
``flex_gpu`` gives): 4 warps and 2 stages, as jax's own Triton decode kernel
(``jax/experimental/pallas/ops/gpu/decode_attention.py``), since a program's work is one
``[G, H]`` by ``[tk, H]`` product per key block, memory-bound. Triton's matmul takes at
least 16 rows, so the ``G`` query heads of a kv head are padded with zero rows to
``Gp = max(16, G)`` rounded to a power of two, computed and dropped, again as there. A
``score_mod`` takes one head, so it runs ``G`` times on the ``[Gp, tk]`` block, each run
keeping its head's row.
``supports`` does not look at the host's backend: the kernel lowers for CUDA anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attnlab.errors import ConfigError
from attnlab.ops.block_mask import EMPTY, FULL, PARTIAL
from attnlab.ops.masks import MaskSpec
from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas import _refmod

_F32 = jnp.float32
DEFAULT_BLOCK_K = 64


@dataclasses.dataclass(frozen=True)
class Config(cm.KeyBlocks):
    B: int
    S: int
    N: int
    K: int
    H: int
    Gp: int  # query heads per program: G padded for Triton's matmul (>= 16, a power of two)
    tk: int
    nk: int
    num_splits: int
    scale: float
    softcap: float | None
    mod: Callable | None
    const_shapes: tuple
    mask_kind: str | None
    mask_names: tuple
    causal: bool
    dense_heads: int
    interpret: bool

    @property
    def per_split(self):  # key blocks per split
        return self.nk // self.num_splits


def _kernel(po, pc, fo, fc, pos_ref, q_ref, k_ref, v_ref, *refs, c: Config):
    nm, nc = len(c.mask_names), len(c.const_shapes)
    mrefs = dict(zip(c.mask_names, refs[:nm], strict=True))
    const_refs, (o_ref, lse_ref) = refs[nm : nm + nc], refs[nm + nc :]
    b, kh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q = q_ref[...]  # [Gp, H]
    q_idx = jnp.full((c.Gp, 1), pos_ref[0], jnp.int32)
    rows = jax.lax.broadcasted_iota(jnp.int32, (c.Gp, 1), 0)
    base = sp * c.per_split

    def score_rows(s0, ks):  # [Gp, tk]: softcap, then row g's score_mod at head kh G + g
        kv_idx = ks + jax.lax.broadcasted_iota(jnp.int32, (1, c.tk), 1)
        s = s0 if c.softcap is None else c.softcap * jnp.tanh(s0 / c.softcap)
        if c.mod is None:
            return s
        out = s
        for g in range(c.G):  # the score_mod takes one head: the whole block, row g kept
            out = jnp.where(rows == g, c.mod(s, b, kh * c.G + g, q_idx, kv_idx, *const_refs), out)
        return out

    def allowed(ks):  # [1 | Gp, tk]
        out = None
        if c.mask_kind == "spec":  # the one query's fields whole, the keys' of the block
            get = cm.field_slices(
                mrefs,
                lambda r: r[...][None],
                lambda r: r[pl.ds(ks, c.tk)][None],
                lambda name, r: r[0] if name == "window" else r[...],
            )
            out = cm.spec_block(c.causal, get, ks, c.tk, 1)[0]
        elif c.mask_kind == "dense":
            r = mrefs["dense"]
            out = (r[:, pl.ds(ks, c.tk)] if len(r.shape) == 2 else r[pl.ds(ks, c.tk)][None]) != 0
        if c.S_pad > c.S:
            pad = ks + jax.lax.broadcasted_iota(jnp.int32, (1, c.tk), 1) < c.S
            out = pad if out is None else out & pad
        return out

    def visit(masked):
        def fn(t, carry, order, row):
            acc, m, den = carry
            local = order[row, sp, t] * c.tk  # k_ref and v_ref hold the split's keys
            ks = base * c.tk + local
            k, v = k_ref[pl.ds(local, c.tk), :], v_ref[pl.ds(local, c.tk), :]
            s0 = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
            s = score_rows(s0 * c.scale, ks)
            ok = allowed(ks) if masked else None
            return cm.online_softmax(acc, m, den, s, ok, v)

        return fn

    carry = (
        jnp.zeros((c.Gp, c.H), _F32),
        jnp.full((c.Gp,), cm.NEG, _F32),
        jnp.zeros((c.Gp,), _F32),
    )
    fp, ff = visit(True), visit(False)
    carry = jax.lax.fori_loop(0, pc[b, sp], lambda t, x: fp(t, x, po, b), carry)
    acc, m, den = jax.lax.fori_loop(0, fc[b, sp], lambda t, x: ff(t, x, fo, b), carry)
    live = den > 0
    o_ref[...] = acc / jnp.where(live, den, 1.0)[:, None]
    lse_ref[...] = jnp.where(live, m + jnp.log(jnp.where(live, den, 1.0)), cm.NEG)


def _row_kinds(mi: cm.MaskInputs, B, S, S_pad, tk):
    """``[B, nk]`` EMPTY / PARTIAL / FULL per batch row and key block."""
    nk = S_pad // tk
    starts = jnp.arange(nk) * tk
    if mi.kind == "spec":
        arrays = dict(zip(mi.names, mi.arrays, strict=True))
        window = arrays.pop("window", None)

        def one(row):
            fields = {n: (x[None] != 0 if n in cm._BOOL else x[None]) for n, x in row.items()}
            spec = MaskSpec(causal=mi.causal, window=None if window is None else window[0],
                            **fields)  # fmt: skip
            return spec.block_any(1, tk)[0], spec.block_all(1, tk)[0]

        rows = {n: (x[:, 0] if n in cm._PER_ROW else x) for n, x in arrays.items()}
        any_BK, all_BK = jax.vmap(one)(rows)
    elif mi.kind == "dense":
        m = mi.arrays[0].reshape(mi.arrays[0].shape[0], -1, nk, tk) != 0
        any_BK, all_BK = m.any((1, 3)), m.all((1, 3))
        any_BK, all_BK = (jnp.broadcast_to(x, (B, nk)) for x in (any_BK, all_BK))
    else:
        any_BK = all_BK = jnp.ones((B, nk), bool)
    any_BK = any_BK & (starts < S)[None]
    all_BK = all_BK & (starts + tk <= S)[None]
    return jnp.where(all_BK, FULL, jnp.where(any_BK, PARTIAL, EMPTY))


def _split_tables(kinds_BK, num_splits):
    """Per (row, split): the PARTIAL and FULL blocks (indices within the split), counts."""
    B, nk = kinds_BK.shape
    k3 = kinds_BK.reshape(B, num_splits, nk // num_splits)
    out = []
    for which in (PARTIAL, FULL):
        hit = k3 == which
        out += [jnp.argsort(~hit, axis=2, stable=True).astype(jnp.int32),
                hit.sum(2).astype(jnp.int32)]  # fmt: skip
    return out


def supports(q_B1NH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, sinks=None, softcap=None,
             block_k=None, num_splits=None, interpret=False, **_):  # fmt: skip
    """None when the decode kernel takes the call, else one line naming the argument."""
    if q_B1NH.ndim == 4 and q_B1NH.shape[1] != 1:
        return f"q_B1NH: one query row per batch row, got T={q_B1NH.shape[1]}; falling back"
    if (reason := cm.check_common(q_B1NH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask,
                                  sinks=sinks, softcap=softcap)) is not None:  # fmt: skip
        return f"{reason}; falling back to the reference decode"
    for name, value in (("block_k", block_k), ("num_splits", num_splits)):
        if value is not None and not (isinstance(value, int) and value >= 1):
            return f"{name}={value!r}: must be a positive integer; falling back"
    missing = None if interpret or score_mod is None else cm.triton_unlowerable(score_mod)
    if missing:
        return (
            f"score_mod: uses {', '.join(missing)}, which the Pallas Triton lowering lacks "
            "(closed-over arrays lower when indexed one entry at a time); falling back"
        )
    if not interpret and block_k is not None and not cm.is_pow2(block_k, 16):
        return f"block_k={block_k}: the Triton kernel takes powers of two >= 16; falling back"
    H = q_B1NH.shape[-1]
    if not interpret and not cm.is_pow2(H, 16):
        return f"q_B1NH: head dim H={H} is not a power of two >= 16 (Triton tiles); falling back"
    return None


def flex_decode_gpu(q_B1NH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, scale=None,
                    sinks=None, softcap=None, block_k=None, num_splits=None,
                    interpret: bool = False):  # fmt: skip
    """``out_B1NH``: each row's query against its cache, in ``num_splits`` (default: as many
    as fill 64-key blocks, at most 8) partial softmaxes combined after the kernel."""
    kw = dict(score_mod=score_mod, mask=mask, sinks=sinks, softcap=softcap, block_k=block_k,
              num_splits=num_splits, interpret=interpret)  # fmt: skip
    if (reason := supports(q_B1NH, k_BSKH, v_BSKH, **kw)) is not None:
        raise ConfigError(reason)
    B, _, N, H = q_B1NH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    Gp = pl.next_power_of_2(max(16, G))
    tk = min(DEFAULT_BLOCK_K if block_k is None else block_k, pl.next_power_of_2(S))
    nk0 = math.ceil(S / tk)
    ns = min(8, nk0) if num_splits is None else min(num_splits, nk0)
    nk = ns * math.ceil(nk0 / ns)
    S_pad = nk * tk
    mi = cm.mask_inputs(mask, B, 1, S, 1, S_pad)
    sm = cm.convert_score_mod(score_mod, Gp, tk)
    consts = () if sm is None else sm.consts
    if isinstance(mask, MaskSpec):
        pos_B = jnp.broadcast_to(jnp.asarray(mask.q_pos, jnp.int32)[:, 0], (B,))
    else:
        pos_B = jnp.full((B,), S - 1, jnp.int32)
    dense_heads = 0
    mask_arrays = list(mi.arrays)
    if mi.kind == "dense":  # [Bm, Nm, 1, S_pad] -> [Bm, Nm, S_pad], per head: [Bm, K Gp, S_pad]
        m = mi.arrays[0][:, :, 0]
        dense_heads = m.shape[1]
        if dense_heads > 1:  # padded heads see no key
            m = m.reshape(m.shape[0], K, G, S_pad)
            m = jnp.pad(m, [(0, 0), (0, 0), (0, Gp - G), (0, 0)]).reshape(-1, K * Gp, S_pad)
        mask_arrays = [m]
    c = Config(
        B=B, S=S, N=N, K=K, H=H, Gp=Gp, tk=tk, nk=nk, num_splits=ns,
        scale=cm.default_scale(scale, H), softcap=None if softcap is None else float(softcap),
        mod=None if sm is None else _refmod.ref_score_fn(sm),
        const_shapes=tuple(x.shape for x in consts),
        mask_kind=mi.kind, mask_names=mi.names, causal=mi.causal, dense_heads=dense_heads,
        interpret=interpret,
    )  # fmt: skip
    kinds = _row_kinds(mi, B, S, S_pad, tk)
    tables = _split_tables(kinds, ns)
    L = S_pad // ns
    pad = lambda x: jnp.pad(x, [(0, 0), (0, S_pad - S), (0, 0), (0, 0)])
    k, v = pad(k_BSKH), pad(v_BSKH)
    q = jnp.pad(q_B1NH.reshape(B, K, G, H), [(0, 0), (0, 0), (0, Gp - G), (0, 0)])
    mask_specs = []
    for name, x in zip(c.mask_names, mask_arrays, strict=True):
        if name == "window":
            mask_specs.append(pl.BlockSpec((1,), lambda *_: (0,)))
        elif name == "dense":
            Bm = x.shape[0]
            pb = (lambda b: b) if Bm > 1 else (lambda b: 0)
            if dense_heads > 1:
                index = lambda b, kh, s, *_, pb=pb: (pb(b), kh, 0)
                mask_specs.append(pl.BlockSpec((None, Gp, S_pad), index))
            else:
                index = lambda b, kh, s, *_, pb=pb: (pb(b), 0, 0)
                mask_specs.append(pl.BlockSpec((None, None, S_pad), index))
        else:
            mask_specs.append(pl.BlockSpec((None, x.shape[1]), lambda b, *_: (b, 0)))
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_, nd=x.ndim: (0,) * nd)
    o, lse = pl.pallas_call(
        functools.partial(_kernel, c=c),
        grid=(B, K, ns),
        in_specs=[whole(t) for t in tables]
        + [
            pl.BlockSpec((None, 1), lambda b, *_: (b, 0)),
            pl.BlockSpec((None, None, Gp, H), lambda b, kh, s: (b, kh, 0, 0)),
            pl.BlockSpec((None, L, None, H), lambda b, kh, s: (b, s, kh, 0)),
            pl.BlockSpec((None, L, None, H), lambda b, kh, s: (b, s, kh, 0)),
        ]
        + mask_specs
        + [whole(x) for x in consts],
        out_specs=[
            pl.BlockSpec((None, None, None, Gp, H), lambda b, kh, s: (b, kh, s, 0, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, kh, s: (b, kh, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, ns, Gp, H), _F32),
            jax.ShapeDtypeStruct((B, K, ns, Gp), _F32),
        ],
        compiler_params=cm.triton_params(interpret, num_warps=4, num_stages=2),
        interpret=interpret,
        name="flex_decode",
    )(*tables, pos_B[:, None], q, k, v, *mask_arrays, *consts)
    o, lse = o[..., :G, :], lse[..., :G]
    # The splits' partial softmaxes, combined (the sinks join the denominator here).
    m = lse.max(2, keepdims=True)
    if sinks is not None:
        sink = jnp.asarray(sinks, _F32).reshape(1, K, 1, G)
        m = jnp.maximum(m, sink)
    w = jnp.exp(lse - m)  # [B, K, ns, G]
    den = w.sum(2)
    if sinks is not None:
        den = den + jnp.exp(sink[:, :, 0] - m[:, :, 0])
    out = (w[..., None] * o).sum(2) / jnp.where(den > 0, den, 1.0)[..., None]
    return out.reshape(B, 1, N, H).astype(q_B1NH.dtype)
