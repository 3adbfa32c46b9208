"""Flex attention: any variant's scores and mask through one op, on every backend.

``flex_attention(q, k, v, score_mod=..., mask=...)`` computes

    s = q.k * scale ; s = softcap(s) ; s = score_mod(s, b, h, q_idx, kv_idx) ; mask ;
    out = softmax(s, with sinks) v

(``attnlab.ops.score_mods`` holds the score function's contract; ``attnlab.ops.attention``
the conventions of masks, sinks and fully masked rows). The mask (a ``MaskSpec`` or a dense
boolean array) compiles to a ``BlockMask`` once per call, shared by the forward and backward
passes: a blockwise kernel skips the (query block, key block) pairs that are ``EMPTY`` and
evaluates no mask on the ``FULL`` ones.

Implementations (``IMPLEMENTATIONS``), one signature:

* ``"reference"``: dense, float32 softmax, the readable ground truth (``O(T S)`` memory);
* ``"chunked"``: ``attnlab.ops.chunked``, pure JAX, blockwise with a custom backward pass,
  ``O(T + S)`` memory: the CPU's path, and every other backend's fallback;
* ``"pallas_gpu"``, ``"pallas_tpu"``: the fused Pallas kernels of ``attnlab.ops.pallas``
  (forward and backward, block skipping), in interpret mode on a CPU (``interpret``);
* ``"splash"``, ``"tokamax"``: library kernels, where installed;
* ``"auto"``: on a CPU, the chunked path; on a GPU, cuDNN for the plain causal case it was
  measured on (``gpu_prefers_cudnn``), else the Pallas GPU kernel; on a TPU, splash, else
  the Pallas TPU kernel. A single query (a decoding step) runs the GPU's decode kernel
  (``attnlab.ops.pallas.decode``, split over the cache) or the one-query path.

A fused kernel that is not installed, or that does not cover a call (its ``supports``
returns a reason), falls back to the next one and finally to ``"chunked"``; each fallback is
logged once, as one line naming the argument, on the ``attnlab.attention`` logger (which
``attnlab train --verbose`` prints: ``log_fallbacks``). Kernels are imported only when asked.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from functools import partial

import jax
import jax.numpy as jnp

from attnlab.ops import kernel_mesh, paths, score_mods
from attnlab.ops.block_mask import BlockMask
from attnlab.ops.chunked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, chunked_attention
from attnlab.ops.dense_attention import (
    _check_shapes,
    gpu_prefers_cudnn,
    one_query_attention,
    reference_attention,
)
from attnlab.ops.masks import MaskSpec
from attnlab.ops.paths import LOGGER, log_fallbacks, say  # noqa: F401  (this module's API)

IMPLEMENTATIONS = ("auto", "reference", "chunked", "pallas_gpu", "pallas_tpu", "splash", "tokamax")

# The fused kernels: implementation -> (module, function[, its supports]). Each has a
# ``supports(q, k, v, **same keywords) -> str | None`` (None: the kernel covers the call;
# else why not), ``supports`` unless named.
KERNELS = {
    "pallas_gpu": ("attnlab.ops.pallas.flex_gpu", "flex_attention_gpu"),
    "pallas_tpu": ("attnlab.ops.pallas.flex_tpu", "flex_attention_tpu"),
    "splash": ("attnlab.ops.pallas.flex_tpu", "splash_attention", "supports_splash"),
    "tokamax": ("attnlab.ops.pallas.tokamax_gpu", "tokamax_attention"),
}
DECODE_KERNEL = ("attnlab.ops.pallas.decode", "flex_decode_gpu")
# A library kernel that does not cover a call hands it to the Pallas kernel of its backend.
LIBRARY_FALLBACKS = {"splash": ("pallas_tpu",), "tokamax": ("pallas_gpu",)}
# What "auto" tries per backend, in order, before the chunked path.
AUTO_KERNELS = {"gpu": ("pallas_gpu",), "tpu": ("splash", "pallas_tpu")}
# The chunked path's blocks under "auto": 64 up to 1,024 queries and keys, then its defaults
# (benchmarks/attention.py; ``attnlab.ops.attention.AUTO_BLOCK``).
AUTO_BLOCK, AUTO_BLOCK_MAX_LEN = 64, 1024


def kernel(name: str):
    """``(fn, supports)`` of a fused kernel, or ``(None, reason)`` when it is not installed."""
    module, fn, *check = KERNELS.get(name, DECODE_KERNEL)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and module.startswith(e.name or "\0"):
            return None, f"implementation={name!r}: {module} is not installed"
        return None, f"implementation={name!r}: {module} cannot be imported ({e})"
    return getattr(mod, fn), getattr(mod, check[0] if check else "supports", lambda *a, **k: None)


def _accepts(fn, name):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind == p.VAR_KEYWORD for p in params)


def _covers(name, q_BTNH, k_BSKH, v_BSKH, kwargs):
    """``(fn, kwargs)`` when kernel ``name`` is installed and covers the call, else
    ``(None, reason)``. A kernel without ``q_offset`` gets it folded into the score
    function (``q_idx + q_offset[b]``)."""
    fn, supports = kernel(name)
    if fn is None:
        return None, supports
    kwargs = dict(kwargs)
    q_offset = kwargs.pop("q_offset", None)
    if q_offset is not None:
        if _accepts(fn, "q_offset"):
            kwargs["q_offset"] = q_offset
        elif kwargs.get("score_mod") is not None:
            kwargs["score_mod"] = _shifted(kwargs["score_mod"], q_offset)
    asked = {k: v for k, v in kwargs.items() if _accepts(supports, k)}
    reason = supports(q_BTNH, k_BSKH, v_BSKH, **asked)
    on_mesh = name == "pallas_tpu" and kernel_mesh.current_mesh() is not None
    if reason is None and on_mesh and kernel_mesh.reads_arrays_per_row(kwargs.get("score_mod")):
        reason = (
            "score_mod: closes over an array read per row and head (e.g. FoX's gate), "
            "which the Mosaic TPU kernel cannot read by a shard's rows inside a mesh; "
            "falling back to chunked"
        )
    return (fn, kwargs) if reason is None else (None, reason)


def _shifted(score_mod, q_offset):
    """``score_mod`` seeing ``q_idx + q_offset[b]`` (``q_offset``: [1|B] int32)."""
    off = jnp.asarray(q_offset, jnp.int32).reshape(-1)

    def mod(s, b, h, q_idx, kv_idx):
        return score_mod(s, b, h, q_idx + off[b if off.shape[0] > 1 else 0], kv_idx)

    return mod


def _auto(q_BTNH, k_BSKH, mask, backend, plain, notes):
    """The candidates ``"auto"`` tries in order (the last, "chunked", always applies); a
    substitution is said in ``notes``.

    cuDNN, where it was measured faster (``gpu_prefers_cudnn``), looks for the local GPU
    while tracing: a program built for a GPU on another host (``paths.target``) takes the
    Pallas GPU kernel in its place, and says so."""
    if backend == "gpu" and plain and gpu_prefers_cudnn(q_BTNH, k_BSKH, mask, None, backend):
        if not paths.lowering_only():
            return ("cudnn",)
        notes.append(
            "implementation='auto': cuDNN on an NVIDIA GPU (it needs the device while "
            "tracing); built for a GPU on another host, pallas_gpu takes its place"
        )
    return AUTO_KERNELS.get(backend, ()) + ("chunked",)


def _check_mask(mask, T, S):
    if mask is None or isinstance(mask, MaskSpec):
        if mask is not None and mask.shape != (T, S):
            raise ValueError(f"mask: a MaskSpec over (T, S)={mask.shape}, the inputs ({T}, {S})")
        return
    shape = getattr(mask, "shape", None)
    if shape is None or len(shape) != 4 or shape[-1] not in (1, S) or shape[-2] not in (1, T):
        raise ValueError(
            f"mask must be None, a MaskSpec or a boolean array [B|1, N|1, T|1, S|1] for "
            f"(T, S)=({T}, {S}); got {type(mask).__name__} of shape {shape}"
        )


def reference_flex(
    q_BTNH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, scale=None, sinks=None,
    softcap=None, q_offset=None,
):  # fmt: skip
    """The dense ground truth of ``flex_attention`` (float32 softmax, ``[B, N, T, S]``)."""
    B, T, N, _ = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    logits_fn = None
    if score_mod is not None:
        score_mods.check_result(score_mod, (B, K, N // K, T, S))
        q_idx = jnp.arange(T, dtype=jnp.int32)[None]
        if q_offset is not None:
            q_idx = jnp.asarray(q_offset, jnp.int32).reshape(-1, 1) + q_idx
        args = score_mods.indices(B, K, N // K, q_idx, jnp.arange(S, dtype=jnp.int32))
        logits_fn = lambda s: score_mods.apply(score_mod, s, *args)
    if isinstance(mask, MaskSpec):
        mask = mask.dense()
    out_BTNH, _ = reference_attention(
        q_BTNH, k_BSKH, v_BSKH, mask=mask, scale=scale, logits_fn=logits_fn, sinks=sinks,
        softcap=softcap,
    )  # fmt: skip
    return out_BTNH


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``flex_attention`` runs for a call: the ``path`` (an implementation, ``"cudnn"``,
    ``"decode"`` or ``"one_query"``), whether it is a fused ``kernel``, and ``fallbacks``:
    one line per candidate that did not take the call, saying why."""

    path: str
    kernel: bool
    fallbacks: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.path + "".join(f"; {f}" for f in self.fallbacks)


def flex_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    score_mod=None,
    mask=None,
    block_mask: BlockMask | None = None,
    scale=None,
    sinks=None,
    softcap: float | None = None,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    q_offset=None,
):
    """Attention with a score function and a (block-sparse) mask; returns ``out_BTNH``.

    Args:
      q_BTNH, k_BSKH, v_BSKH: queries, keys, values; K must divide N (grouped heads).
      score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (``ops.score_mods``), or
        None; it may close over arrays, which receive gradients.
      mask: None, a ``MaskSpec``, or a boolean array [B|1, N|1, T, S] (True = may attend).
      block_mask: a ``BlockMask`` of ``mask`` for the blocks used (None: built here).
      scale: logit scale (default 1/sqrt(H)); sinks: per-head sink logits [N];
        softcap: ``c`` of ``c * tanh(s / c)`` (a Python number).
      implementation: one of ``IMPLEMENTATIONS``.
      block_q, block_k: the blockwise paths' block sizes (None: their defaults).
      backend: the platform the call is compiled for, ``"cpu"``, ``"gpu"`` or ``"tpu"``
        (None: ``paths.backend()``, JAX's default unless ``paths.target`` says otherwise).
        A kernel is built for that platform whatever the host, so the program lowers for it
        anywhere and runs only there (on a CPU host, run a GPU or TPU kernel with
        ``interpret=True``).
      interpret: run a Pallas kernel in interpret mode (None: when ``backend`` is "cpu").
      q_offset: added to the query indices the score function sees (an int or [B]) where no
        ``MaskSpec`` gives positions: with a ``MaskSpec`` that places the queries and keys
        (``for_cache``, a ring's slots), the score function sees those positions instead.
    """
    chosen = _choose(
        q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask, block_mask=block_mask,
        scale=scale, sinks=sinks, softcap=softcap, implementation=implementation,
        block_q=block_q, block_k=block_k, backend=backend, interpret=interpret,
        q_offset=q_offset,
    )  # fmt: skip
    for line in chosen.plan.fallbacks:
        say(line)
    paths.reached(chosen.plan.path)
    return chosen.run()


def plan(q_BTNH, k_BSKH, v_BSKH, **kwargs) -> Plan:
    """What ``flex_attention`` with the same arguments would run, and why (nothing is
    computed; the arguments may be ``jax.ShapeDtypeStruct``s where no mask or score function
    reads their values)."""
    return _choose(q_BTNH, k_BSKH, v_BSKH, **kwargs).plan


@dataclasses.dataclass(frozen=True)
class _Chosen:
    plan: Plan
    run: object  # () -> out_BTNH


def _choose(
    q_BTNH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, block_mask=None, scale=None,
    sinks=None, softcap=None, implementation="auto", block_q=None, block_k=None,
    backend=None, interpret=None, q_offset=None,
):  # fmt: skip
    _check_shapes(q_BTNH, k_BSKH, v_BSKH)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is unknown; use one of {IMPLEMENTATIONS}"
        )
    B, T, N, _ = q_BTNH.shape
    S = k_BSKH.shape[1]
    _check_mask(mask, T, S)
    if score_mod is not None:
        score_mods.check_signature(score_mod)
        if isinstance(mask, MaskSpec) and not mask.aligned:  # it sees the spec's positions
            score_mod, q_offset = score_mods.with_positions(score_mod, mask), None
    if isinstance(mask, MaskSpec) and mask.allowed is not None:
        mask = mask.dense()  # a choice of keys no rule describes: every path takes it dense
    backend = paths.backend() if backend is None else backend
    interpret = backend == "cpu" if interpret is None else interpret
    plain = score_mod is None and sinks is None and softcap is None
    fallbacks = []
    if implementation == "auto":
        candidates = _auto(q_BTNH, k_BSKH, mask, backend, plain and block_mask is None, fallbacks)
        if T == 1 and block_mask is None:  # a decoding step
            candidates = ("decode", "one_query") if backend == "gpu" else ("one_query",)
    elif implementation in KERNELS:
        candidates = (implementation, *LIBRARY_FALLBACKS.get(implementation, ()), "chunked")
        if T == 1 and block_mask is None and implementation in ("pallas_gpu", "tokamax"):
            candidates = ("decode", *candidates)  # a decoding step: the GPU's one-query kernel
    else:
        candidates = (implementation,)
    common = dict(scale=scale, sinks=sinks, softcap=softcap)
    qkv = (q_BTNH, k_BSKH, v_BSKH)

    def chosen(impl, run):
        kernel = impl in KERNELS or impl in ("decode", "cudnn")
        return _Chosen(Plan(impl, kernel, tuple(fallbacks)), run)

    for impl in candidates:
        if impl == "reference":
            return chosen(impl, partial(
                reference_flex, *qkv, score_mod=score_mod, mask=mask, q_offset=q_offset, **common
            ))  # fmt: skip
        if impl == "one_query":
            dense = mask.dense() if isinstance(mask, MaskSpec) else mask
            return chosen(impl, partial(
                one_query_attention, *qkv, mask=dense, score_mod=score_mod, q_offset=q_offset,
                **common,
            ))  # fmt: skip
        if impl == "cudnn":
            return chosen(impl, partial(
                jax.nn.dot_product_attention, *qkv, scale=scale, is_causal=True,
                implementation="cudnn",
            ))  # fmt: skip
        if impl == "chunked":
            bq, bk = block_q, block_k
            if bq is None and bk is None and implementation == "auto":
                small = max(T, S) <= AUTO_BLOCK_MAX_LEN
                bq = bk = AUTO_BLOCK if small else None
            return chosen(impl, partial(
                chunked_attention, *qkv, mask=mask, score_mod=score_mod, block_mask=block_mask,
                block_q=DEFAULT_BLOCK_Q if bq is None else bq,
                block_k=DEFAULT_BLOCK_K if bk is None else bk,
                q_offset=q_offset, **common,
            ))  # fmt: skip
        if impl == "decode":
            kwargs = dict(score_mod=score_mod, mask=mask, block_k=block_k, num_splits=None,
                          interpret=interpret, **common)  # fmt: skip
        else:
            kwargs = dict(
                score_mod=score_mod, mask=mask, block_mask=block_mask, block_q=block_q,
                block_k=block_k, interpret=interpret, **common,
            )  # fmt: skip
        if q_offset is not None:
            kwargs["q_offset"] = q_offset
        fn, given = _covers(impl, *qkv, kwargs)
        if fn is not None:
            return chosen(impl, runner(fn, qkv, given))
        fallbacks.append(_fallback(given, f"the next path ({_next(candidates, impl)!r})"))
    raise AssertionError("unreachable: the chunked path ends every candidate list")


def _fallback(reason, to):
    """One line: the reason, and where the call goes (unless the reason says it)."""
    return reason if "falling back" in reason else f"{reason}; falling back to {to}"


def _next(candidates, impl):
    return candidates[candidates.index(impl) + 1]


def decode_kernel(q_BTNH, k_BSKH, v_BSKH, *, backend, **kwargs):
    """The GPU's decode kernel (``attnlab.ops.pallas.decode``) when it is installed and
    covers a one-query call, else None (the reason logged)."""
    if backend != "gpu" or q_BTNH.shape[1] != 1:
        return None
    fn, given = _covers("decode", q_BTNH, k_BSKH, v_BSKH, kwargs)
    if fn is None:
        say(_fallback(given, "the one-query path"))
        return None
    return runner(fn, (q_BTNH, k_BSKH, v_BSKH), given)


def runner(fn, qkv, given):
    """``() -> out_BTNH``: kernel ``fn`` on ``qkv`` with keywords ``given``; under a mesh
    inside ``shard_map`` (``attnlab.ops.kernel_mesh``: a kernel is opaque to the
    partitioner)."""
    mesh = kernel_mesh.current_mesh()
    if mesh is None:
        return partial(fn, *qkv, **given)
    return partial(kernel_mesh.partitioned, fn, *qkv, given, mesh)
