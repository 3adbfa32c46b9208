"""Tokamax's fused attention (``tokamax.dot_product_attention``: Mosaic GPU on Hopper and
Blackwell, Triton elsewhere, forward and backward) for the flex calls it covers on an
NVIDIA GPU. Tokamax is optional (``pip install 'attnlab[tokamax]'``) and imported on use.

What it takes, in its public API: grouped heads, a softcap (``logits_soft_cap``, on the
scaled logits, as here), causal and sliding-window masks over aligned positions
(``is_causal``, ``local_window_size``), ragged key lengths (``key_value_seq_lengths``) and a
dense mask. What sends a call elsewhere, each named by ``supports``: a ``score_mod``, sinks
(no argument for them), and the MaskSpec rules it could only take as a dense ``[T, S]`` mask
(packed documents, prefix-LM, validity arrays), which would give up the O(T) memory the flex
kernels keep.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.errors import ConfigError
from attnlab.ops.masks import MaskSpec
from attnlab.ops.pallas import _common as cm

_FALLBACK = "falling back to pallas_gpu"


def _tokamax():
    try:
        import tokamax
    except ImportError:
        return None
    return tokamax


def supports(q_BTNH, k_BSKH, v_BSKH, *, score_mod=None, mask=None, sinks=None, softcap=None,
             block_mask=None, interpret=False, **_):  # fmt: skip
    """None when Tokamax covers the call, else one line naming the argument and the fallback.
    ``interpret=True`` (the CPU tests) skips the GPU check: Tokamax's XLA path then runs."""
    if (reason := cm.check_common(q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, mask=mask,
                                  sinks=sinks, softcap=softcap)) is not None:  # fmt: skip
        return f"{reason}; falling back to chunked"
    if score_mod is not None:
        return f"score_mod: Tokamax's public attention takes no score_mod; {_FALLBACK}"
    if sinks is not None:
        return f"sinks: Tokamax's attention has no sink logits; {_FALLBACK}"
    if block_mask is not None:
        return f"block_mask: Tokamax builds its own blocks from the mask; {_FALLBACK}"
    if isinstance(mask, MaskSpec):
        for name in ("q_segment", "prefix_length", "k_valid", "q_valid"):
            if getattr(mask, name) is not None:
                return (
                    f"mask.{name}: Tokamax would need it as a dense [T, S] mask (O(T^2) "
                    f"memory); {_FALLBACK}"
                )
        static = "Tokamax takes a static one"
        if (reason := cm.fixed_rules_reason(mask, "Tokamax's", static, _FALLBACK)) is not None:
            return reason
    if _tokamax() is None:
        return f"tokamax: not installed (pip install 'attnlab[tokamax]'); {_FALLBACK}"
    if not interpret and jax.default_backend() != "gpu":
        return f"tokamax: its fused kernels need an NVIDIA GPU; {_FALLBACK}"
    return None


def tokamax_attention(q_BTNH, k_BSKH, v_BSKH, *, mask=None, scale=None, softcap=None,
                      interpret=False, implementation=None, **kwargs):  # fmt: skip
    """``out_BTNH`` from ``tokamax.dot_product_attention``; ``implementation`` is Tokamax's
    (None: it chooses, Mosaic GPU or Triton on a GPU; "xla" runs on the CPU)."""
    if (reason := supports(q_BTNH, k_BSKH, v_BSKH, mask=mask, softcap=softcap,
                           interpret=interpret, **kwargs)) is not None:  # fmt: skip
        raise ConfigError(reason)
    tokamax = _tokamax()
    # Tokamax reads its absl flags on first use and, unparsed, parses sys.argv: the host
    # program's own arguments (attnlab's, pytest's), which it rejects. Its defaults serve.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    B = q_BTNH.shape[0]
    args = dict(scale=cm.default_scale(scale, q_BTNH.shape[-1]), logits_soft_cap=softcap)
    if isinstance(mask, MaskSpec):
        args["is_causal"] = bool(mask.causal)
        if mask.window is not None:  # keys p - window < k <= p
            args.update(is_causal=True, local_window_size=(int(mask.window) - 1, 0))
        if mask.k_length is not None:
            lengths = jnp.broadcast_to(jnp.asarray(mask.k_length, jnp.int32), (B,))
            args["key_value_seq_lengths"] = lengths
    elif mask is not None:
        args["mask"] = jnp.asarray(mask, bool)
    with jax.numpy_rank_promotion("allow"):  # Tokamax's mask code broadcasts ranks implicitly
        out = tokamax.dot_product_attention(
            q_BTNH, k_BSKH, v_BSKH, implementation=implementation, **args
        )
    return out.astype(q_BTNH.dtype)
