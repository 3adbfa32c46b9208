"""The dense attention paths as pure functions: ``reference_attention`` (the readable
einsum version every other path is checked against), ``one_query_attention`` (a decoding
step, keys contracted in the cache's order), and the test of whether ``"auto"`` runs cuDNN
(``gpu_prefers_cudnn``). ``attnlab.ops.attention`` dispatches to them (its docstring holds
the conventions: shapes, masks, biases, ``sinks`` and ``softcap``), and so does
``attnlab.ops.flex``, which is why they sit below both.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp

from attnlab.ops import paths, score_mods
from attnlab.ops.linear import dropout
from attnlab.ops.masks import MASK_VALUE, MaskSpec
from attnlab.ops.precision import upcast, wide


def _check_shapes(q_BTNH, k_BSKH, v_BSKH):
    if q_BTNH.ndim != 4 or k_BSKH.ndim != 4 or v_BSKH.ndim != 4:
        raise ValueError(
            "dot_product_attention expects q [B, T, N, H] and k, v [B, S, K, H]; got shapes "
            f"q={q_BTNH.shape}, k={k_BSKH.shape}, v={v_BSKH.shape}"
        )
    if k_BSKH.shape != v_BSKH.shape:
        raise ValueError(f"k and v must have the same shape, got {k_BSKH.shape} and {v_BSKH.shape}")
    n, k = q_BTNH.shape[2], k_BSKH.shape[2]
    if n % k:
        raise ValueError(f"the number of q heads N={n} must be a multiple of kv heads K={k}")
    if q_BTNH.shape[-1] != k_BSKH.shape[-1]:
        raise ValueError(f"head dims differ: q H={q_BTNH.shape[-1]}, k H={k_BSKH.shape[-1]}")


def to_BKGTS(x, B, K, G, T, S):
    """Broadcasts a [B|1, N|1, T|1, S|1] mask or bias to [B, K, G, T, S]."""
    x = jnp.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"masks and biases must be 4-D [B, N|1, T, S], got shape {x.shape}")
    if x.shape[1] == 1:
        x = x[:, :, None]  # [B, 1, 1, T, S]
    else:
        x = x.reshape(x.shape[0], K, G, x.shape[2], x.shape[3])
    return jnp.broadcast_to(x, (B, K, G, T, S))


def _masked_softmax(logits, mask, sinks=None):
    """Softmax over the last axis where ``mask`` (None: everywhere) allows; zero elsewhere,
    so a fully masked row gets all-zero weights rather than a uniform average.

    ``sinks`` (broadcastable to ``logits[..., :1]``): one more logit per row that joins the
    softmax and whose weight is dropped (a fully masked row puts all of it on the sink).
    """
    if mask is not None:
        logits = jnp.where(mask, logits, MASK_VALUE)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks, logits.shape[:-1] + (1,)).astype(logits.dtype)
        logits = jnp.concatenate([logits, sink], axis=-1)
    weights = jax.nn.softmax(logits, axis=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    return weights if mask is None else jnp.where(mask, weights, 0.0)


def _softcap(logits, softcap):
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _sinks_BKG(sinks_N, K, G):
    """Per-head sink logits [N] as [1, K, G] in at least float32 (query head n = k * G + g)."""
    sinks_N = jnp.asarray(sinks_N)
    if sinks_N.shape != (K * G,):
        raise ValueError(f"sinks: one logit per query head, [{K * G}]; got {sinks_N.shape}")
    return upcast(sinks_N).reshape(1, K, G)


def reference_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    mask=None,
    bias=None,
    scale=None,
    logits_fn=None,
    dropout_rate=0.0,
    dropout_key=None,
    sinks=None,
    softcap=None,
):
    """Einsum attention; returns ``(out_BTNH, weights_BNTS)``.

    ``weights_BNTS`` are the softmax weights before attention dropout, which (with
    ``dropout_key``) drops weights only in the product with ``v``.

    ``logits_fn``, if given, maps the float32 logits ``[B, K, G, T, S]`` (already scaled and
    biased, and capped by ``softcap``) to new logits before masking: the hook for score
    variants. ``sinks`` ([N] logits) and ``softcap``: see the module docstring.
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    scale = H**-0.5 if scale is None else scale
    q_BTKGH = q_BTNH.reshape(B, T, K, G, H)
    acc = wide(q_BTNH, k_BSKH)  # float32, or float64 for a float64 model
    logits_BKGTS = (
        jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=acc) * scale
    )
    if bias is not None:
        logits_BKGTS = logits_BKGTS + to_BKGTS(bias, B, K, G, T, S).astype(acc)
    logits_BKGTS = _softcap(logits_BKGTS, softcap)
    if logits_fn is not None:
        logits_BKGTS = logits_fn(logits_BKGTS)
    mask_BKGTS = None if mask is None else to_BKGTS(mask, B, K, G, T, S).astype(bool)
    sinks_BKGTS = None if sinks is None else _sinks_BKG(sinks, K, G)[..., None, None]
    weights_BKGTS = _masked_softmax(logits_BKGTS, mask_BKGTS, sinks_BKGTS)
    used_BKGTS = dropout(weights_BKGTS, dropout_rate, dropout_key)
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", used_BKGTS.astype(v_BSKH.dtype), v_BSKH)
    return out_BTKGH.reshape(B, T, N, H), weights_BKGTS.reshape(B, N, T, S)


def one_query_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    mask=None,
    bias=None,
    scale=None,
    sinks=None,
    softcap=None,
    score_mod=None,
    q_offset=None,
):
    """Attention of a single query per row (a decoding step), with the keys and values
    contracted in ``[B, K, S, H]`` order, the order the KV cache stores them.

    ``score_mod`` (``attnlab.ops.score_mods``) sees the query at index ``q_offset`` (an int
    or [B]: its cache position, so a variant decodes with the scores it trained with).

    The cache hands a layer over as a transposed view (``[B, S, K, H]``); contracting that
    view, XLA:CPU copies each layer's keys and values into a new layout at every token
    (12 copies of 0.1 ms per token for GPT-2 small). Swapping the axes back cancels the
    view, and the dots read the cache where it lies: 0.29 ms against 1.9 ms for 12 layers'
    attention over 128 cached tokens (one query, 12 heads of 64, one row).
    """
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    scale = H**-0.5 if scale is None else scale
    q_BKGH = q_BTNH.reshape(B, K, G, H)
    k_BKSH, v_BKSH = jnp.swapaxes(k_BSKH, 1, 2), jnp.swapaxes(v_BSKH, 1, 2)
    acc = wide(q_BTNH, k_BSKH)
    logits_BKGS = jnp.einsum("BKGH,BKSH->BKGS", q_BKGH, k_BKSH, preferred_element_type=acc)
    logits_BKGS = logits_BKGS * scale
    if bias is not None:
        logits_BKGS = logits_BKGS + to_BKGTS(bias, B, K, G, 1, S)[:, :, :, 0].astype(acc)
    logits_BKGS = _softcap(logits_BKGS, softcap)
    if score_mod is not None:
        logits_BKGS = _one_query_mod(score_mod, logits_BKGS, q_offset)
    mask_BKGS = None if mask is None else to_BKGTS(mask, B, K, G, 1, S)[:, :, :, 0].astype(bool)
    sinks_BKGS = None if sinks is None else _sinks_BKG(sinks, K, G)[..., None]
    weights_BKGS = _masked_softmax(logits_BKGS, mask_BKGS, sinks_BKGS)
    out_BKGH = jnp.einsum("BKGS,BKSH->BKGH", weights_BKGS.astype(v_BSKH.dtype), v_BKSH)
    return out_BKGH.reshape(B, 1, N, H)


def _one_query_mod(score_mod, logits_BKGS, q_offset):
    B, K, G, S = logits_BKGS.shape
    score_mods.check_result(score_mod, (B, K, G, 1, S))
    q_idx = jnp.zeros((1, 1), jnp.int32) if q_offset is None else q_offset
    q_idx = jnp.asarray(q_idx, jnp.int32).reshape(-1, 1)
    args = score_mods.indices(B, K, G, q_idx, jnp.arange(S, dtype=jnp.int32))
    return score_mods.apply(score_mod, logits_BKGS[:, :, :, None], *args)[:, :, :, 0]


@functools.cache
def _nvidia_gpu() -> bool:
    try:
        return "cuda" in jax.extend.backend.get_backend("gpu").platform_version.lower()
    except RuntimeError:  # no GPU backend
        return False


def gpu_prefers_cudnn(q_BTNH, k_BSKH, mask, bias, backend: str) -> bool:
    """Whether ``"auto"`` runs cuDNN's fused kernel: on an NVIDIA GPU, for what was measured
    there (GPT-2 small training and causal attention up to T = 128k on an H200, 3.6-10x
    faster than XLA's from 8k on; ``docs/benchmarks.md``): a causal-only ``MaskSpec`` (given
    to cuDNN as its flag), no bias, bfloat16 or float16, as many key heads as query heads,
    a head size that is a multiple of 8 up to 128, and T a multiple of 64. Anything else
    keeps XLA's path until measured."""
    q_dtype, H = q_BTNH.dtype, q_BTNH.shape[-1]
    return (
        backend == "gpu"
        and isinstance(mask, MaskSpec)
        and mask.causal_only
        and bias is None
        and q_dtype in (jnp.bfloat16, jnp.float16)
        and k_BSKH.shape[2] == q_BTNH.shape[2]
        and H % 8 == 0
        and H <= 128
        and q_BTNH.shape[1] % 64 == 0
        and (paths.nvidia_target() or _nvidia_gpu())
    )
