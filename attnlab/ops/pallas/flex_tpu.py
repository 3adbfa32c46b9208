"""Flex attention on a TPU, two ways:

* ``splash_attention`` (``supports_splash``): JAX's splash attention where it covers the
  call: no ``score_mod``, a ``MaskSpec`` of causal / sliding-window rules over aligned
  positions and segment ids (packed documents), a softcap (``attn_logits_soft_cap``), sinks,
  grouped heads (its grouped form: keys and values are not repeated), blocks that are
  multiples of 128 dividing T and S. Its block sparsity comes from its own static mask.
* ``flex_attention_tpu`` (``supports``): everything else (any ``score_mod``, prefix-LM,
  ragged lengths, validity, dense masks): the kernels of ``flex_gpu`` with Mosaic-TPU block
  shapes (heads before time, so a block's last two dims are ``[block, H]``) and the block
  tables as scalar prefetch (``PrefetchScalarGridSpec``).

Both run in Pallas interpret mode on the CPU (``interpret=True``), which is how they are
tested; Mosaic's own lowering (block shapes, ``fori_loop`` bounds read from SMEM) is
unchecked without a TPU.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from attnlab.errors import ConfigError
from attnlab.ops.masks import MaskSpec
from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas import flex_gpu

SPLASH_BLOCK = 128
_FALLBACK = "falling back to pallas_tpu"


def _on_tpu(interpret, name):
    if not interpret and jax.default_backend() != "tpu":
        return f"{name}: needs a TPU (or interpret=True)"
    return None


def supports(q_BTNH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, sinks=None, softcap=None,
             block_q=None, block_k=None, block_mask=None, interpret=False, **_):  # fmt: skip
    """None when the Mosaic-TPU flex kernel takes the call, else one line naming the argument."""
    if (reason := cm.check_common(q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask,
                                  sinks=sinks, softcap=softcap)) is not None:  # fmt: skip
        return f"{reason}; falling back to chunked"
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
    if (reason := _on_tpu(interpret, "pallas_tpu")) is not None:
        return f"{reason}; falling back to chunked"
    return None


def flex_attention_tpu(q_BTNH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, block_mask=None,
                       scale=None, sinks=None, softcap=None, block_q=None, block_k=None,
                       interpret: bool = False):  # fmt: skip
    """Flex attention through the Mosaic-TPU kernels: ``out_BTNH`` (see ``flex_gpu``)."""
    out, _ = flex_gpu.attention(
        q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask, block_mask=block_mask,
        scale=scale, sinks=sinks, softcap=softcap, block_q=block_q, block_k=block_k,
        interpret=interpret, layout="BNTH", prefetch=True, reason_fn=supports,
    )  # fmt: skip
    return out


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
        if (mask.causal or mask.window is not None) and not mask.aligned:
            return (
                f"mask: splash's causal/window rules need queries and keys at 0..T-1; {_FALLBACK}"
            )
        if mask.window is not None:
            try:
                int(mask.window)
            except (TypeError, jax.errors.ConcretizationTypeError):
                return f"mask.window: a traced window; splash's mask is static; {_FALLBACK}"
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
    if (reason := _on_tpu(interpret, "splash")) is not None:
        return f"{reason}; {_FALLBACK}"
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
