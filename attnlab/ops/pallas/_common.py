"""What the Pallas attention kernels share: the converted ``score_mod``, the block grid of a
call (``Blocks``), the mask as kernel inputs and its evaluation on one block, the block
tables split into partial and full blocks, and the checks behind each module's
``supports``.

Inside a kernel program a block of logits is ``[tq, tk]``; ``b`` and ``h`` are scalars and
``q_idx``/``kv_idx`` the ``[tq, 1]`` / ``[1, tk]`` query and key indices of the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.errors import ConfigError
from attnlab.ops.block_mask import FULL, PARTIAL, BlockMask
from attnlab.ops.masks import MASK_VALUE, MaskSpec
from attnlab.ops.pallas import _refmod
from attnlab.ops.pallas._refmod import ScoreMod

NEG = MASK_VALUE  # finite: a row with every key masked keeps finite maxima and zero weights

_Q_ROW = ("q_pos", "q_segment", "q_valid")
_K_ROW = ("k_pos", "k_segment", "k_valid")
_PER_ROW = ("k_length", "prefix_length")
_BOOL = ("q_valid", "k_valid")
MASK_FIELDS = _Q_ROW + _K_ROW + _PER_ROW + ("window",)


# ------------------------------------------------------------------------------------------
# score_mod
# ------------------------------------------------------------------------------------------


def check_score_mod(score_mod, argname="score_mod"):
    """One line naming ``argname`` unless it is a callable of five positional arguments."""
    if score_mod is None:
        return None
    if not callable(score_mod):
        return f"{argname}: must be a function (score, b, h, q_idx, kv_idx) -> score"
    try:
        inspect.signature(score_mod).bind(0, 0, 0, 0, 0)
    except TypeError:
        return f"{argname}: must take five arguments (score, b, h, q_idx, kv_idx)"
    except ValueError:  # builtins without a signature: let tracing decide
        pass
    return None


def convert_score_mod(score_mod, tq, tk, argname="score_mod") -> ScoreMod | None:
    """``score_mod`` traced on one ``[tq, tk]`` block, its closed-over arrays hoisted into
    explicit arguments (so a kernel takes them as inputs and gradients reach them)."""
    if score_mod is None:
        return None
    if (reason := check_score_mod(score_mod, argname)) is not None:
        raise ConfigError(reason)
    example = (
        jax.ShapeDtypeStruct((tq, tk), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((tq, 1), jnp.int32),
        jax.ShapeDtypeStruct((1, tk), jnp.int32),
    )
    try:
        closed = jax.make_jaxpr(score_mod)(*example)
    except TypeError as e:
        raise ConfigError(
            f"{argname}: cannot be called as (score, b, h, q_idx, kv_idx): {e}"
        ) from None
    out = closed.out_avals
    if len(out) != 1 or out[0].shape != (tq, tk) or not jnp.issubdtype(out[0].dtype, jnp.floating):
        got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in out)
        raise ConfigError(
            f"{argname}: must return a float array of the score's shape [{tq}, {tk}] "
            f"(elementwise, no reduction or scalar result); got {got}"
        )
    jaxpr = closed.jaxpr

    def fn(s, b, h, q_idx, kv_idx, *consts):
        (res,) = jax.core.eval_jaxpr(jaxpr, list(consts), s, b, h, q_idx, kv_idx)
        return res.astype(jnp.float32)

    return ScoreMod(fn, tuple(jnp.asarray(c) for c in closed.consts), jaxpr)


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


def _unlowerable(eqn, rules):
    """The name of what the Triton lowering lacks for ``eqn``, or None."""
    if eqn.primitive not in rules:
        return eqn.primitive.name
    if eqn.primitive is jax.lax.concatenate_p and len(eqn.invars) > 2:
        return "concatenate of more than two arrays"
    return None


class _ShapeRef:
    """Stands in for a kernel ref while a ``score_mod`` is traced for analysis: a load gives
    zeros of the loaded shape (index arrays and scalars, or slices), no gather."""

    def __init__(self, x):
        self.shape, self.dtype = x.shape, x.dtype

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if idx == (Ellipsis,):
            return jnp.zeros(self.shape, self.dtype)
        arrays = [i for i in idx if hasattr(i, "shape") and jnp.ndim(i) > 0]
        if arrays:
            shape = jnp.broadcast_shapes(*(i.shape for i in arrays))
        else:
            shape = tuple(
                n if isinstance(i, slice) else i.size
                for i, n in zip(idx, self.shape, strict=True)
                if isinstance(i, slice) or hasattr(i, "size") and not hasattr(i, "shape")
            )
        return jnp.zeros(shape, self.dtype)


def triton_unlowerable(score_mod, tq=16, tk=16, *, refs=True):
    """The primitives a kernel would run for ``score_mod`` (traced on a ``[tq, tk]`` block,
    its closed-over arrays read from refs as in the flex kernels, or as values with
    ``refs=False``) that the Pallas Triton lowering has no rule for, sorted; empty when it
    lowers."""
    from jax._src.pallas.triton import lowering

    sm = convert_score_mod(score_mod, tq, tk)
    if refs:
        held = [_ShapeRef(c) for c in sm.consts]
        fn = _refmod.ref_score_fn(sm)
    else:
        held, fn = sm.consts, sm.fn
    closed = jax.make_jaxpr(lambda *a: fn(*a, *held))(
        jnp.zeros((tq, tk), jnp.float32), jnp.int32(0), jnp.int32(0),
        jnp.zeros((tq, 1), jnp.int32), jnp.zeros((1, tk), jnp.int32),
    )  # fmt: skip
    rules = lowering.triton_lowering_rules
    missing = {_unlowerable(eqn, rules) for eqn in _equations(closed.jaxpr)}
    return sorted(missing - {None})


def scores(s0, softcap, mod, b, h, q_idx, kv_idx, consts):
    """Logits after the softcap and the ``score_mod``, from the scaled ``q.k`` ``s0``."""
    s = s0 if softcap is None else softcap * jnp.tanh(s0 / softcap)
    return s if mod is None else mod(s, b, h, q_idx, kv_idx, *consts)


# ------------------------------------------------------------------------------------------
# The block grid of a call
# ------------------------------------------------------------------------------------------


class KeyBlocks:
    """``G`` and ``S_pad`` of a static description with the fields ``N``, ``K`` (query and
    key-value heads), ``nk`` and ``tk`` (key blocks of ``tk`` keys)."""

    @property
    def G(self):
        return self.N // self.K

    @property
    def S_pad(self):
        return self.nk * self.tk


@dataclasses.dataclass(frozen=True)
class Blocks(KeyBlocks):
    """What a flex kernel's static description starts with: the batch, the query and key
    lengths, the query and key-value heads, the head dim, and the block grid (``nq`` blocks
    of ``tq`` queries, ``nk`` of ``tk`` keys)."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    tq: int
    tk: int
    nq: int
    nk: int

    @property
    def T_pad(self):
        return self.nq * self.tq


# ------------------------------------------------------------------------------------------
# The mask as kernel inputs
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MaskInputs:
    """The mask of a call as arrays a kernel takes: ``kind`` None (no mask), "spec" (the
    MaskSpec's fields, one row per batch row: ``names`` say which) or "dense" (one array
    ``[B|1, N|1, T_pad, S_pad]`` int8)."""

    kind: str | None
    names: tuple[str, ...]
    arrays: tuple
    causal: bool = False


def mask_inputs(mask, B, T, S, T_pad, S_pad) -> MaskInputs:
    if mask is None:
        return MaskInputs(None, (), ())
    if isinstance(mask, MaskSpec):
        spec = mask.padded(T_pad, S_pad)
        names, arrays = [], []
        for name in MASK_FIELDS:
            x = getattr(spec, name)
            if x is None:
                continue
            x = jnp.asarray(x)
            if name == "window":
                x = x.astype(jnp.int32).reshape(1)
            elif name in _PER_ROW:
                x = jnp.broadcast_to(x.astype(jnp.int32).reshape(-1, 1), (B, 1))
            else:
                x = jnp.broadcast_to(x.astype(jnp.int32), (B, x.shape[-1]))
            names.append(name)
            arrays.append(x)
        return MaskInputs("spec", tuple(names), tuple(arrays), spec.causal)
    m = jnp.asarray(mask, bool)
    m = jnp.pad(m, [(0, 0), (0, 0), (0, T_pad - T), (0, S_pad - S)])
    return MaskInputs("dense", ("dense",), (m.astype(jnp.int8),))


def fixed_rules_reason(mask, rules: str, static: str, fallback: str) -> str | None:
    """For a library kernel whose causal and window rules are fixed (queries and keys at
    ``0..T-1``, a static window): a line naming what of the MaskSpec ``mask`` it cannot
    take (``rules``: whose rules, ``static``: that the window must be static), or None."""
    if (mask.causal or mask.window is not None) and not mask.aligned:
        return f"mask: {rules} causal/window rules need queries and keys at 0..T-1; {fallback}"
    if mask.window is not None:
        try:
            int(mask.window)
        except (TypeError, jax.errors.ConcretizationTypeError):
            return f"mask.window: a traced window; {static}; {fallback}"
    return None


def online_softmax(acc, m, den, s, ok, v):
    """One key block of the online softmax: the float32 ``(acc, m, den)`` (weighted values,
    running max, running sum) after the block's logits ``s`` ``[rows, tk]`` (``ok``: where
    allowed, or None) and its values ``v``."""
    if ok is not None:
        s = jnp.where(ok, s, NEG)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[:, None])
    if ok is not None:
        p = jnp.where(ok, p, 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * corr[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc, m_new, den * corr + p.sum(-1)


def field_slices(fields, q_rows, k_cols, rest):
    """``get(name)`` for ``spec_block`` over ``fields`` (name -> array or ref; a name not
    there gives None): a query-indexed field through ``q_rows(x)``, a key-indexed one
    through ``k_cols(x)``, the others (per row, the window) through ``rest(name, x)``."""

    def get(name):
        x = fields.get(name)
        if x is None:
            return None
        if name in _Q_ROW:
            return q_rows(x)
        if name in _K_ROW:
            return k_cols(x)
        return rest(name, x)

    return get


def spec_block(causal, get, k_start, tk, rows):
    """``[R, tq, tk]`` bool: the MaskSpec rules on one block. ``get(name)`` gives a field's
    slice for the block (``[R, tq]``, ``[R, tk]``, ``[R]`` per row, ``[1]`` window) or
    None; the rules are MaskSpec's own."""
    vals = {name: get(name) for name in MASK_FIELDS}
    for name in _BOOL:
        if vals[name] is not None:
            vals[name] = vals[name] != 0
    k_index = k_start + jax.lax.broadcasted_iota(jnp.int32, (tk,), 0)
    spec = MaskSpec(
        q_pos=vals["q_pos"],
        k_pos=vals["k_pos"],
        causal=causal,
        window=vals["window"],
        k_length=vals["k_length"],
        prefix_length=vals["prefix_length"],
    )
    out = spec._allowed(
        vals["q_pos"],
        vals["k_pos"],
        k_index,
        vals["q_segment"],
        vals["k_segment"],
        vals["q_valid"],
        vals["k_valid"],
    )
    return jnp.broadcast_to(out[:, 0], (rows,) + out.shape[2:])


# ------------------------------------------------------------------------------------------
# Block tables
# ------------------------------------------------------------------------------------------


def _rows(kind, which):
    hit = kind == which
    order = jnp.argsort(~hit, axis=1, stable=True).astype(jnp.int32)
    return order, hit.sum(1).astype(jnp.int32)


def split_tables(block_mask: BlockMask, transpose=False):
    """``(partial_order, partial_count, full_order, full_count)``: per query block (per key
    block with ``transpose``) the PARTIAL and the FULL blocks it visits, ascending; EMPTY
    ones appear in neither, so a kernel never visits them."""
    kind = block_mask.kind_QK.T if transpose else block_mask.kind_QK
    return (*_rows(kind, PARTIAL), *_rows(kind, FULL))


def resolve_block_mask(mask, block_mask, T, S, block_q, block_k):
    """The call's BlockMask: the one given (its sizes must match) or one built from ``mask``."""
    if block_mask is not None:
        if (block_mask.T, block_mask.S) != (T, S):
            raise ConfigError(
                f"block_mask: built for (T, S)=({block_mask.T}, {block_mask.S}), "
                f"the inputs are ({T}, {S}); build it from the same mask"
            )
        return block_mask
    if mask is None or isinstance(mask, MaskSpec):
        return BlockMask.from_spec(mask, T, S, block_q=block_q, block_k=block_k)
    m = jnp.asarray(mask, bool)
    return BlockMask.from_dense(m, block_q=block_q, block_k=block_k)


# ------------------------------------------------------------------------------------------
# Checks behind supports()
# ------------------------------------------------------------------------------------------


def check_common(q, k, v, *, score_mod=None, mask=None, sinks=None, softcap=None):
    """The reasons no kernel here takes a call, as one line naming the argument, or None."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return "q_BTNH/k_BSKH/v_BSKH: must be 4-D [B, T, N, H] / [B, S, K, H]"
    B, T, N, H = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != H:
        return f"k_BSKH/v_BSKH: shapes {k.shape}/{v.shape} do not match q_BTNH {q.shape}"
    K = k.shape[2]
    if N % K:
        return f"k_BSKH: its {K} kv heads must divide the {N} query heads"
    for name, x in (("q_BTNH", q), ("k_BSKH", k), ("v_BSKH", v)):
        if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            return f"{name}: dtype {x.dtype} is not float32, bfloat16 or float16"
    if (reason := check_score_mod(score_mod)) is not None:
        return reason
    if sinks is not None and tuple(np.shape(sinks)) != (N,):
        return f"sinks: one logit per query head, [{N}]; got {list(np.shape(sinks))}"
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        return f"softcap: must be a positive number, got {softcap!r}"
    if mask is not None and not isinstance(mask, MaskSpec):
        shape = tuple(np.shape(mask))
        if (
            len(shape) != 4
            or shape[2:] != (T, k.shape[1])
            or shape[0] not in (1, B)
            or (shape[1] not in (1, N))
        ):
            want = f"[{B}|1, {N}|1, {T}, {k.shape[1]}]"
            return f"mask: a dense mask must be [B|1, N|1, T, S] = {want}; got {list(shape)}"
    if isinstance(mask, MaskSpec) and mask.shape != (T, k.shape[1]):
        return f"mask: the MaskSpec covers (T, S)={mask.shape}, the inputs ({T}, {k.shape[1]})"
    return None


def triton_params(interpret, num_warps, num_stages=2):
    """A GPU kernel's compiler parameters: Triton's, which select the Triton lowering (a
    ``pallas_call`` without them goes to Mosaic GPU); None in interpret mode."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def eager():
    """``jax.ensure_compile_time_eval()`` (tables of a mask known while tracing are computed
    then), except inside ``shard_map``, where eager ops on arrays of the manual mesh are
    refused: there the tables are traced."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.manual_axes:
        return contextlib.nullcontext()
    return jax.ensure_compile_time_eval()


def pad_to(x, axis, size):
    """``x`` zero-padded along ``axis`` to ``size``."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def is_pow2(x, least=1):
    return isinstance(x, int) and x >= least and x & (x - 1) == 0


def default_scale(scale, H):
    return 1.0 / math.sqrt(H) if scale is None else float(scale)
