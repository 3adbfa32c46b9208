"""Flex attention on a TPU: splash attention where it covers the call, else the flex kernels
of ``flex_gpu`` with Mosaic-TPU block shapes (heads before time, so a block's last two dims
are ``[block, H]``) and the block tables as scalar prefetch (``PrefetchScalarGridSpec``).
"""

from __future__ import annotations

from attnlab.ops.pallas import _common as cm
from attnlab.ops.pallas import flex_gpu


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
    if not interpret:
        import jax

        if jax.default_backend() != "tpu":
            return "pallas_tpu: needs a TPU (or interpret=True); falling back to chunked"
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
