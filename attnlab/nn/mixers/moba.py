"""Mixture of Block Attention (``mixer="moba"``; Lu et al. 2025, "MoBA: Mixture of Block
Attention for Long-Context LLMs"): the keys are cut into blocks of ``block_size``; query
``q_t`` of head ``n`` scores each block that ends before its own by

    s_j = q_t . mean(K_j)        (the block's mean-pooled keys, the head's kv-head)

and attends, with one softmax, the keys of its ``topk`` best past blocks and of its own
block (causally inside it). ``topk`` counts the past blocks alone, so ``topk >= J - 1``
(``J`` blocks in all) is dense causal attention. The choice is a hard top-k: no gradient
flows through the gate scores (as in the paper).

The choice becomes a ``[B, N, T, S]`` mask (``ops.sparse_blocks.moba_selection``) for
``ops.flex_attention``, whose key blocks are ``block_size`` long, so a blockwise path skips
a key block that no query of a query block chose. Parameters and cache: ``mha``'s (keys
and values); the block means are recomputed from the cached keys at every call (a decode
step reads the past blocks, complete in the cache, and its own block is always taken).
Causal decoders only; the keys' slots are their positions (a linear cache, no window).

Named intermediates (``attnlab.nn.probe``): ``q``, ``k``, ``v``, ``z`` as ``mha``'s, and,
read-only, ``blocks``: the chosen blocks, ``[B, N, T, J]`` bool.
"""

from __future__ import annotations

import dataclasses

from attnlab import ops
from attnlab.contracts.mixer import MixerCall, MixerSettings, register_mixer
from attnlab.errors import ConfigError
from attnlab.nn import probe
from attnlab.nn.mixers.mha import Attention
from attnlab.ops import sparse_blocks


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_sparse_model(cfg, name: str) -> None:
    """The model rules of a block-sparse mixer: causal, no attention window (a linear cache
    whose slots are positions), no attention dropout."""
    if not cfg.causal:
        raise ConfigError(
            f"ModelConfig.causal=False is invalid with mixer={name!r}: its blocks are chosen "
            "among the keys before each query; set causal=True"
        )
    if any(w is not None for w in cfg.layer_windows(cfg.n_layers)):
        raise ConfigError(
            f"ModelConfig.sliding_window is invalid with mixer={name!r}: it chooses its own "
            "keys over a linear cache; set sliding_window=None and no layer_pattern window"
        )
    if cfg.position in ("alibi", "relative"):
        raise ConfigError(
            f"ModelConfig.position={cfg.position!r} is invalid with mixer={name!r}: its "
            "attention takes no position bias; use position='rope' or 'none'"
        )
    if cfg.attention_dropout:
        raise ConfigError(
            f"ModelConfig.attention_dropout={cfg.attention_dropout} is invalid with "
            f"mixer={name!r}: it drops no attention weights; set attention_dropout=0.0"
        )


def flex_implementation(cfg) -> str:
    """``ModelConfig.attention_impl`` as ``ops.flex_attention`` names it (the dense XLA
    path is its reference; cuDNN takes no mask array, so ``"auto"`` chooses)."""
    impl = {"xla": "reference", "cudnn": "auto"}.get(cfg.attention_impl, cfg.attention_impl)
    return impl if impl in ops.flex.IMPLEMENTATIONS else "auto"


def sequence_mask(call: MixerCall, T: int):
    """The call's ``MaskSpec`` (a plain causal one when the call has none)."""
    if call.mask is None:
        return ops.MaskSpec.for_sequence(T, causal=True)
    if not isinstance(call.mask, ops.MaskSpec):
        raise ConfigError(
            "ModelConfig.mesh.context > 1 is invalid with a block-sparse mixer: set "
            "mesh.context to 1"
        )
    return call.mask


@register_mixer("moba")
class MoBA(Attention):
    """Softmax attention over each query's top-k key blocks and its own block."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        block_size: int = 64  # keys per block
        topk: int = 3  # past blocks each query attends besides its own

        def validate(self, cfg) -> None:
            if not _positive_int(self.block_size):
                self.fail("block_size", "a positive integer (keys per block; MoBA uses 512)")
            if not _positive_int(self.topk):
                self.fail("topk", "a positive integer (past blocks per query besides its own)")
            check_sparse_model(cfg, "moba")

    # Its keys are blocks chosen per query from the whole sequence's block summaries, which
    # the split sequence's ring and all-gather (per chunk pair) do not compute: attention
    # stays whole.
    context_parallel = False

    def __init__(self, cfg, settings=None, *, rngs):
        settings = self.Settings() if settings is None else settings
        super().__init__(cfg, settings, rngs=rngs)
        self.block_size = settings.block_size
        self.topk = settings.topk

    def chosen_keys(self, q_BTNH, k_BSKH, mask):
        """``[B, N, T, S]`` bool: the keys each query attends (its blocks, within ``mask``)."""
        S = k_BSKH.shape[1]
        chosen_BNTJ = sparse_blocks.moba_selection(
            q_BTNH, k_BSKH, mask.q_pos, block=self.block_size, topk=self.topk
        )
        probe.record("blocks", chosen_BNTJ)
        return sparse_blocks.blocks_to_keys(chosen_BNTJ, self.block_size, S) & mask.dense()

    def __call__(self, x_BTD, call: MixerCall):
        cfg = self.cfg
        if call.cache is not None and call.cache.ring is not None:
            raise ConfigError("mixer='moba' decodes with a linear cache: set no attention window")
        q_BTNH = probe.tap("q", self.query(x_BTD, call))
        cache, k_BSKH, v_BSKH = self.keys_values(x_BTD, call)
        k_BSKH, v_BSKH = probe.tap("k", k_BSKH), probe.tap("v", v_BSKH)
        mask = self.chosen_keys(q_BTNH, k_BSKH, sequence_mask(call, x_BTD.shape[1]))
        out_BTNH = ops.flex_attention(
            q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), mask=mask,
            scale=cfg.attn_scale, implementation=flex_implementation(cfg),
            block_q=cfg.attention_block_q, block_k=self.block_size, backend=self.backend,
        )  # fmt: skip
        return self.output(probe.tap("z", out_BTNH), x_BTD), cache, None
