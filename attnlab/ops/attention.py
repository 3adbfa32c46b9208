"""Scaled dot-product attention as a pure function.

Conventions (see ``attnlab.dims``): ``q_BTNH``, ``k_BSKH``, ``v_BSKH`` with K dividing N
(MHA when K == N, GQA when 1 < K < N, MQA when K == 1). Masks are boolean, broadcastable to
``[B, N|1, T, S]``, True = may attend, or a ``masks.MaskSpec`` describing one. ``bias`` is
added to the logits and broadcastable to ``[B, N|1, T, S]``, or a ``positions.PositionBias``
describing one. The dense implementations build descriptions with ``.dense()``; the chunked
one evaluates them block by block. The softmax runs in at least float32. A query row whose
keys are all masked gets an all-zero output and all-zero weights, with finite gradients.

Two options change the softmax itself, on the reference, chunked and one-query paths (the
fused ones fall back to the reference when either is given): ``softcap`` caps the scaled,
biased logits at ``c * tanh(s / c)`` (Gemma 2), and ``sinks`` gives each head a learned
logit that joins the softmax's denominator and takes weight without a value ("Efficient
Streaming LMs with Attention Sinks", gpt-oss): ``out = sum_s softmax([s_1..s_S, sink])_s v_s``
over the real keys, whose weights then sum to less than one.

Implementations, all behind one signature:

* ``"reference"``: a readable einsum version, the one every other path is checked against.
* ``"xla"``: ``jax.nn.dot_product_attention(implementation="xla")``.
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU only).
* ``"auto"`` (the model default): on CPU, ``"chunked"`` from ``AUTO_CHUNKED_MIN_T`` queries
  on, with ``AUTO_BLOCK`` blocks up to ``AUTO_BLOCK_MAX_LEN`` (its own defaults beyond),
  and ``one_query_attention`` for a single query (a decoding step), where no weights,
  ``logits_fn`` or dropout are asked for; on an NVIDIA GPU, ``"cudnn"`` for the case
  measured there (``gpu_prefers_cudnn``: plain causal self-attention in 16-bit floats);
  otherwise ``jax.nn.dot_product_attention``'s own choice, which is XLA's.
* ``"chunked"``: ``attnlab.ops.chunked``, blockwise with an online softmax and a custom
  backward pass: memory linear in T and S, masked-out blocks skipped, pure JAX (any
  backend). ``block_q``/``block_k`` set its block sizes. It has no ``logits_fn`` (pass a
  ``score_mod``) and no attention dropout (both raise a ``ValueError``); ``softcap``,
  ``sinks`` and ``score_mod`` it has.

* ``"pallas_gpu"``, ``"pallas_tpu"``, ``"splash"``, ``"tokamax"``: the fused kernels of
  ``attnlab.ops.flex``, each falling back (named, on the ``attnlab.attention`` logger) to
  the chunked path where it is absent or does not cover the call.

A score function, ``score_mod(score, b, h, q_idx, kv_idx)`` (``attnlab.ops.score_mods``),
changes each logit after the cap and before the mask on every path; a call with one under
``"auto"`` goes to ``attnlab.ops.flex.flex_attention`` (the chunked path on a CPU, a fused
kernel elsewhere). ``logits_fn``, a map of the whole logits array, keeps the reference path.
On a GPU or TPU an ALiBi or T5 ``PositionBias`` reaches the kernels as a score function.

``return_weights=True`` always runs the reference path, since the fused kernels do not
materialise the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp

from attnlab.ops import paths, score_mods
from attnlab.ops.chunked import chunked_attention
from attnlab.ops.dense_attention import (  # noqa: F401  (also read from here)
    _check_shapes,
    gpu_prefers_cudnn,
    one_query_attention,
    reference_attention,
    to_BKGTS,
)
from attnlab.ops.masks import MaskSpec
from attnlab.ops.positions import PositionBias
from attnlab.ops.precision import wide

# The fused kernels of ``attnlab.ops.flex`` (imported when asked; each falls back, named,
# to the chunked path where it is absent or does not cover the call).
KERNEL_IMPLEMENTATIONS = ("pallas_gpu", "pallas_tpu", "splash", "tokamax")
IMPLEMENTATIONS = ("reference", "xla", "cudnn", "auto", "chunked") + KERNEL_IMPLEMENTATIONS
BLOCKWISE = ("chunked",) + KERNEL_IMPLEMENTATIONS  # the paths with block sizes

# On CPU the blockwise path beats XLA's dense softmax for training from 128 queries on
# (benchmarks/attention.py, forward + backward, causal, B=8, N=6, H=64, 2 cores, ms for
# T = 128 / 256 / 512 / 1024: xla 16.9 / 84.3 / 255 / 1,493, chunked with 64 x 64 blocks
# 14.2 / 48.2 / 148 / 550, with 256 x 256 blocks 13.4 / 76.0 / 216 / 598); a 6 x 384
# model at context 256 trained 1.03-1.14x faster with it.
AUTO_CHUNKED_MIN_T = 128
AUTO_BLOCK = 64
AUTO_BLOCK_MAX_LEN = 1024


def _fused_attention(q_BTNH, k_BSKH, v_BSKH, *, mask, bias, scale, implementation, backend):
    B, T, N, _ = q_BTNH.shape
    S = k_BSKH.shape[1]
    impl = None if implementation == "auto" else implementation
    if isinstance(mask, MaskSpec) and mask.causal_only and backend != "cpu":
        # The kernel's own causal flag: no [B, 1, T, S] mask is built or read (cuDNN turns
        # an array mask into a bias and computes every block). XLA:CPU ran the flag's own
        # mask no faster than the array (a 4 x 128 training step, 2.5% slower, in noise).
        return jax.nn.dot_product_attention(
            q_BTNH, k_BSKH, v_BSKH, bias=bias, scale=scale, is_causal=True, implementation=impl
        )
    if isinstance(mask, MaskSpec):
        mask = mask.dense()
    if mask is not None:
        mask = jnp.broadcast_to(jnp.asarray(mask, bool), (B, mask.shape[1], T, S))
    if bias is not None:
        bias = jnp.broadcast_to(jnp.asarray(bias), (B, bias.shape[1], T, S)).astype(q_BTNH.dtype)
    out_BTNH = jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, bias=bias, mask=mask, scale=scale, implementation=impl
    )
    if mask is not None:
        # jax.nn gives fully masked rows a uniform average of v; attnlab's contract is zeros.
        any_BNT = jnp.broadcast_to(mask.any(-1), (B, N, T)) if mask.shape[1] == 1 else mask.any(-1)
        out_BTNH = out_BTNH * jnp.transpose(any_BNT, (0, 2, 1))[..., None].astype(out_BTNH.dtype)
    return out_BTNH


def cpu_prefers_chunked(T: int, backend: str) -> bool:
    """Whether ``"auto"`` runs the chunked path for ``T`` queries on ``backend`` (when nothing
    rules it out)."""
    return T >= AUTO_CHUNKED_MIN_T and backend == "cpu"


def _resolve_auto(q_BTNH, k_BSKH, mask, bias, *, backend, changed, block_q, block_k):
    """``(implementation, block_q, block_k)`` that ``"auto"`` runs for a call asking for no
    weights, ``logits_fn`` or dropout: cuDNN where ``gpu_prefers_cudnn`` (not with sinks or
    a softcap: ``changed``), the chunked path where ``cpu_prefers_chunked`` (with
    ``AUTO_BLOCK`` blocks up to ``AUTO_BLOCK_MAX_LEN`` unless blocks are given), else still
    ``"auto"`` (a CPU decoding step's one-query path, or ``jax.nn``'s own choice)."""
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    if not changed and gpu_prefers_cudnn(q_BTNH, k_BSKH, mask, bias, backend):
        if not paths.lowering_only():
            return "cudnn", block_q, block_k
        paths.say(
            "implementation='auto': cuDNN on an NVIDIA GPU (it needs the device while "
            "tracing); built for a GPU on another host, a Pallas kernel takes its place"
        )
    if cpu_prefers_chunked(T, backend):
        if max(T, S) <= AUTO_BLOCK_MAX_LEN and block_q is None and block_k is None:
            return "chunked", AUTO_BLOCK, AUTO_BLOCK
        return "chunked", block_q, block_k
    return "auto", block_q, block_k


def _refuse_on_chunked(logits_fn, dropout_rate, implementation):
    """The blockwise paths take a per-entry ``score_mod``, not a whole-array ``logits_fn``."""
    if logits_fn is not None:
        raise ValueError(
            f"logits_fn is not supported by implementation={implementation!r} (it maps the "
            "whole [T, S] logits): pass an elementwise score_mod(score, b, h, q_idx, kv_idx) "
            "instead, or use implementation='reference'"
        )
    raise ValueError(
        f"attention dropout (dropout_rate={dropout_rate}) is not supported by "
        f"implementation={implementation!r}: set the rate to 0 or use implementation='reference'"
    )


def dot_product_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    mask=None,
    bias=None,
    scale=None,
    return_weights=False,
    implementation="reference",
    logits_fn: Callable | None = None,
    dropout_rate: float = 0.0,
    dropout_key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    sinks=None,
    softcap: float | None = None,
    backend: str | None = None,
    score_mod: Callable | None = None,
    block_mask=None,
):
    """Scaled dot-product attention.

    Args:
      q_BTNH, k_BSKH, v_BSKH: queries, keys, values; K must divide N.
      mask: boolean, broadcastable to [B, N|1, T, S]; True = may attend; or a ``MaskSpec``.
      bias: added to the logits, broadcastable to [B, N|1, T, S] (ALiBi, relative bias); or
        a ``PositionBias``.
      scale: logit scale; defaults to 1/sqrt(H).
      return_weights: also return the attention weights [B, N, T, S] (at least float32).
      implementation: one of ``IMPLEMENTATIONS``.
      logits_fn: optional map of the whole logits (reference path only); an elementwise
        variant passes ``score_mod`` instead, which every path takes.
      dropout_rate, dropout_key: attention dropout on the weights (reference path); no
        dropout without a key.
      block_q, block_k: the blockwise implementations' block sizes (None: their defaults).
      sinks: per-head sink logits [N], or None (see the module docstring).
      softcap: ``c`` of the logit cap ``c * tanh(s / c)`` (a Python number), or None.
      backend: the platform ``"auto"`` chooses for ("cpu", "gpu", "tpu"); models pass the one
        they were built for, so nothing ambient changes the path. None: JAX's default backend.
      score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied after the cap
        and before the mask (``attnlab.ops.score_mods``; ``attnlab.ops.flex``); ``q_idx``
        and ``kv_idx`` are the positions a ``MaskSpec`` gives the queries and keys.
      block_mask: a precomputed ``BlockMask`` of ``mask`` (blockwise paths).

    Returns:
      ``out_BTNH``, or ``(out_BTNH, weights_BNTS)`` when ``return_weights``.
    """
    _check_shapes(q_BTNH, k_BSKH, v_BSKH)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is unknown; use one of {IMPLEMENTATIONS}"
        )
    drop = dropout_key is not None and dropout_rate > 0.0
    if (block_q is not None or block_k is not None) and implementation not in BLOCKWISE:
        raise ValueError(
            f"block_q/block_k set the blockwise implementations' blocks; implementation="
            f"{implementation!r} has none: leave them None or use one of {BLOCKWISE}"
        )
    T = q_BTNH.shape[1]
    plain = not return_weights and logits_fn is None and not drop
    backend = paths.backend() if backend is None else backend
    changed = sinks is not None or softcap is not None  # the fused kernels have neither
    score_mod = score_mods.with_positions(score_mod, mask)  # indices are positions from here
    if isinstance(mask, MaskSpec) and mask.allowed is not None:
        mask = mask.dense()  # a choice of keys per query, which the paths take as an array
    q_offset = None
    softmax = {"sinks": sinks, "softcap": softcap}
    kernel = implementation in KERNEL_IMPLEMENTATIONS or (
        implementation == "auto" and backend in ("gpu", "tpu")
    )
    if kernel and plain and softcap is None and isinstance(bias, PositionBias):
        bias_mod = bias.score_mod()  # ALiBi / T5 buckets per entry: kernels take them
        if bias_mod is not None:
            score_mod, bias = score_mods.compose(bias_mod, score_mod), None
    flexible = score_mod is not None or block_mask is not None
    if plain and bias is None and (implementation in KERNEL_IMPLEMENTATIONS or
                                   (flexible and implementation == "auto")):  # fmt: skip
        from attnlab.ops import flex

        return flex.flex_attention(
            q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask, block_mask=block_mask,
            scale=scale, implementation=implementation, block_q=block_q, block_k=block_k,
            backend=backend, q_offset=q_offset, **softmax,
        )  # fmt: skip
    if implementation in KERNEL_IMPLEMENTATIONS:  # with a bias, weights, logits_fn or dropout
        from attnlab.ops import flex

        what = "bias" if bias is not None else "logits_fn/return_weights/dropout"
        flex.say(f"{what}: implementation={implementation!r} takes none; falling back to "
                 f"{'chunked' if plain else 'reference'}")  # fmt: skip
        implementation = "chunked" if plain else "reference"
    if implementation == "auto" and plain:
        implementation, block_q, block_k = _resolve_auto(
            q_BTNH, k_BSKH, mask, bias, backend=backend, changed=changed or flexible,
            block_q=block_q, block_k=block_k,
        )  # fmt: skip
        if implementation == "auto" and flexible:  # a bias beside the score_mod
            implementation = "chunked"
        if implementation == "auto" and backend in ("gpu", "tpu") and bias is None:
            out = _fused_kernel(q_BTNH, k_BSKH, v_BSKH, mask, scale, backend, softmax)
            if out is not None:
                return out
    if implementation == "chunked" and not return_weights:
        if logits_fn is not None or drop:
            _refuse_on_chunked(logits_fn, dropout_rate, implementation)
        blocks = {n: v for n, v in (("block_q", block_q), ("block_k", block_k)) if v is not None}
        paths.reached("chunked")
        return chunked_attention(
            q_BTNH, k_BSKH, v_BSKH, mask=mask, bias=bias, scale=scale, score_mod=score_mod,
            block_mask=block_mask, q_offset=q_offset, **softmax, **blocks,
        )  # fmt: skip
    if isinstance(bias, PositionBias):
        bias = bias.dense()
    # jax.nn's XLA attention takes its softmax in float32: a float64 call keeps the reference.
    fused = not (return_weights or implementation == "reference" or logits_fn is not None
                 or drop or changed or flexible or wide(q_BTNH) != jnp.float32)  # fmt: skip
    one_query = implementation == "auto" and plain and T == 1 and backend == "cpu"
    if isinstance(mask, MaskSpec) and (one_query or not fused):
        mask = mask.dense()  # the fused path keeps a spec to pass a causal flag
    if one_query:
        paths.reached("one_query")
        return one_query_attention(
            q_BTNH, k_BSKH, v_BSKH, mask=mask, bias=bias, scale=scale, score_mod=score_mod,
            q_offset=q_offset, **softmax,
        )  # fmt: skip
    if not fused:
        paths.reached("reference")
        if score_mod is not None:
            logits_fn = _with_score_mod(score_mod, logits_fn, q_BTNH, k_BSKH, q_offset)
        out_BTNH, weights_BNTS = reference_attention(
            q_BTNH, k_BSKH, v_BSKH, mask=mask, bias=bias, scale=scale, logits_fn=logits_fn,
            dropout_rate=dropout_rate, dropout_key=dropout_key, **softmax,
        )  # fmt: skip
        return (out_BTNH, weights_BNTS) if return_weights else out_BTNH
    paths.reached("cudnn" if implementation == "cudnn" else "xla")
    return _fused_attention(
        q_BTNH, k_BSKH, v_BSKH, mask=mask, bias=bias, scale=scale,
        implementation=implementation, backend=backend,
    )  # fmt: skip


def _with_score_mod(score_mod, logits_fn, q_BTNH, k_BSKH, q_offset):
    """The reference path's ``logits_fn``: ``score_mod`` over the whole logits, then
    ``logits_fn`` (if any)."""
    B, T, N, _ = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    score_mods.check_result(score_mod, (B, K, N // K, T, S))
    q_idx = jnp.arange(T, dtype=jnp.int32)[None]
    if q_offset is not None:
        q_idx = q_offset.reshape(-1, 1) + q_idx
    args = score_mods.indices(B, K, N // K, q_idx, jnp.arange(S, dtype=jnp.int32))

    def fn(logits_BKGTS):
        logits_BKGTS = score_mods.apply(score_mod, logits_BKGTS, *args)
        return logits_BKGTS if logits_fn is None else logits_fn(logits_BKGTS)

    return fn


def _fused_kernel(q_BTNH, k_BSKH, v_BSKH, mask, scale, backend, softmax):
    """A GPU/TPU kernel of ``attnlab.ops.flex`` for a call ``"auto"`` would give XLA's dense
    path (the decode kernel for one query on a GPU), or None (the reason logged)."""
    from attnlab.ops import flex

    if q_BTNH.shape[1] == 1:
        run = flex.decode_kernel(
            q_BTNH, k_BSKH, v_BSKH, backend=backend, score_mod=None, mask=mask, scale=scale,
            block_k=None, num_splits=None, interpret=False, **softmax,
        )  # fmt: skip
        if run is not None:
            paths.reached("decode")
        return None if run is None else run()
    kwargs = dict(score_mod=None, mask=mask, block_mask=None, scale=scale, block_q=None,
                  block_k=None, interpret=False, **softmax)  # fmt: skip
    for name in flex.AUTO_KERNELS.get(backend, ()):
        fn, given = flex._covers(name, q_BTNH, k_BSKH, v_BSKH, kwargs)
        if fn is not None:
            paths.reached(name)
            return flex.runner(fn, (q_BTNH, k_BSKH, v_BSKH), given)()
        flex.say(flex._fallback(given, "XLA's attention"))
    return None
