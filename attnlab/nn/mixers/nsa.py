"""Native Sparse Attention (``mixer="nsa"``; Yuan et al. 2025, "Native Sparse Attention:
Hardware-Aligned and Natively Trainable Sparse Attention"): each query attends three
branches, each with its own keys and values, and mixes them by gates of the input,

    o_t = sum_c g_t^c Attn(q_t, K_t^c, V_t^c),    g_t^c = sigmoid(x_t W_g^c + b_g^c),

per head, for c in

* ``cmp``, compressed: blocks of ``compress_block`` (l) keys every ``compress_stride`` (d),
  each mapped to one key (and value) by a learned MLP over the block with an intra-block
  position embedding; a query attends the blocks it may attend whole (complete, causal);
* ``slc``, selected: keys in blocks of ``select_block`` (l'); a block's importance is the
  compressed branch's attention probability of the compression blocks that overlap it
  (eq. 9 by the blocks' spatial relation), summed over the query heads of a kv-head group
  so the group shares its blocks; each query attends its ``top_n`` most important blocks,
  the first block and its ``local_blocks`` latest (its own included) always among them,
  causally inside its own;
* ``win``, a sliding window of the ``window`` latest keys.

The selected and window branches run through ``ops.flex_attention``: the window as the
call's ``MaskSpec`` with a window, the selection as a ``[B, N, T, S]`` mask from the chosen
blocks (key blocks of ``select_block``, so a blockwise path skips the blocks no query of a
query block chose); the compressed branch, whose probabilities the selection reads, is a
dense softmax over the ``S / d`` compressed keys (``ops.sparse_blocks``). The choice is a
hard top-n; gradients reach the compression MLP through the compressed branch's output.

Parameters: ``mha``'s (the selected branch's ``k_DKH``/``v_DKH``), ``cmp_k_DKH``,
``cmp_v_DKH``, ``win_k_DKH``, ``win_v_DKH``, the compression MLPs of keys and values
(``cmp_<k|v>_pos_PH``, ``_in_PHZ``, ``_in_bias_Z``, ``_out_ZH``, hidden width Z = head_dim)
and the gates ``gate_DNZ``/``gate_bias_NZ`` (Z = the three branches). QK-norm and RoPE
apply to every branch's keys (the compressed ones before compression). Cache: per-token
``keys``/``values`` (selected), ``cmp_keys``/``cmp_values`` and ``window_keys``/
``window_values``; the compressed keys and values are recomputed from the cached
``cmp_`` entries at every call, so a decode step sees the blocks completed so far.
Causal decoders only; the keys' slots are their positions (a linear cache, no model window).

Named intermediates (``attnlab.nn.probe``): ``q`` and ``z`` as ``mha``'s, and, read-only,
``blocks`` (the chosen selection blocks, ``[B, N, T, J]`` bool) and ``gates`` (``[B, T, N,
3]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import ops
from attnlab.contracts.mixer import MixerCall, MixerSettings, register_mixer
from attnlab.errors import ConfigError
from attnlab.nn import probe
from attnlab.nn.layers import normal
from attnlab.nn.mixers.mha import Attention
from attnlab.nn.mixers.moba import (
    _positive_int,
    check_sparse_model,
    flex_implementation,
    sequence_mask,
)
from attnlab.ops import sparse_blocks
from attnlab.ops.linear import add_bias, dense

BRANCHES = ("cmp", "slc", "win")  # the order of the gates' Z axis


@register_mixer("nsa")
class NSA(Attention):
    """Gated compressed, selected and sliding-window attention."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        compress_block: int = 32  # l: keys per compression block
        compress_stride: int = 16  # d: keys between compression blocks' starts
        select_block: int = 64  # l': keys per selection block
        top_n: int = 16  # selection blocks per query (the forced ones included)
        local_blocks: int = 2  # latest selection blocks always kept (the own one included)
        window: int = 512  # w: keys of the sliding-window branch

        def validate(self, cfg) -> None:
            for name, what in (
                ("compress_block", "keys per compression block; NSA uses 32"),
                ("compress_stride", "keys between compression blocks; NSA uses 16"),
                ("select_block", "keys per selection block; NSA uses 64"),
                ("top_n", "selection blocks per query; NSA uses 16"),
                ("window", "keys of the sliding window; NSA uses 512"),
            ):
                if not _positive_int(getattr(self, name)):
                    self.fail(name, f"a positive integer ({what})")
            local = self.local_blocks
            if not (isinstance(local, int) and not isinstance(local, bool) and local >= 0):
                self.fail("local_blocks", "a non-negative integer (NSA keeps 2)")
            d = self.compress_stride
            if d > self.compress_block or self.compress_block % d:
                self.fail("compress_block", f"a multiple of compress_stride={d}, at least it")
            if self.select_block % d:
                self.fail("select_block", f"a multiple of compress_stride={d}")
            if self.top_n <= local:
                self.fail("top_n", f"more than local_blocks={local} (the first block is kept too)")
            check_sparse_model(cfg, "nsa")

    # Its branches choose and compress keys from the whole sequence, which the split
    # sequence's ring and all-gather (per chunk pair) do not compute: attention stays whole.
    context_parallel = False

    def __init__(self, cfg, settings=None, *, rngs: nnx.Rngs):
        settings = self.Settings() if settings is None else settings
        super().__init__(cfg, settings, rngs=rngs)
        self.settings = settings
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        std, pd, P = cfg.init_std, cfg.param_dtype, settings.compress_block
        zeros = lambda *s: nnx.Param(jnp.zeros(s, jnp.dtype(pd)))
        for branch in ("cmp", "win"):
            for kv in ("k", "v"):
                setattr(self, f"{branch}_{kv}_DKH", normal(rngs, (D, K, H), std, pd))
                setattr(self, f"{branch}_{kv}_bias_KH", zeros(K, H) if cfg.attn_bias else None)
        for kv in ("k", "v"):
            setattr(self, f"cmp_{kv}_pos_PH", normal(rngs, (P, H), std, pd))
            setattr(self, f"cmp_{kv}_in_PHZ", normal(rngs, (P, H, H), (P * H) ** -0.5, pd))
            setattr(self, f"cmp_{kv}_in_bias_Z", zeros(H))
            setattr(self, f"cmp_{kv}_out_ZH", normal(rngs, (H, H), H**-0.5, pd))
        self.gate_DNZ = normal(rngs, (D, N, len(BRANCHES)), std, pd)
        self.gate_bias_NZ = zeros(N, len(BRANCHES))

    @classmethod
    def cache_entries(cls, cfg, settings):
        entries = super().cache_entries(cfg, settings)
        for branch in ("cmp", "window"):
            entries[f"{branch}_keys"] = entries["keys"]
            entries[f"{branch}_values"] = entries["values"]
        return entries

    def branch_kv(self, x_BTD, call: MixerCall, branch: str):
        """``(cache, k_BSKH, v_BSKH)`` of the ``cmp`` or ``win`` branch (through the cache's
        ``<cmp|window>_keys``/``_values`` when decoding)."""
        k = self._project(
            x_BTD, getattr(self, f"{branch}_k_DKH"), getattr(self, f"{branch}_k_bias_KH")
        )
        v = self._project(
            x_BTD, getattr(self, f"{branch}_v_DKH"), getattr(self, f"{branch}_v_bias_KH")
        )
        if self.k_norm is not None:
            k = self._qk_norm(self.k_norm, k)
        k_BTKH, v_BTKH = self._rope(k, call.positions_BT, call.rope_theta), v
        cache = call.cache
        if cache is None:
            return None, k_BTKH, v_BTKH
        role = {"cmp": "cmp", "win": "window"}[branch]
        cache, k_BKSH = cache.append(f"{role}_keys", k_BTKH)
        cache, v_BKSH = cache.append(f"{role}_values", v_BTKH)
        return cache, jnp.swapaxes(k_BKSH, 1, 2), jnp.swapaxes(v_BKSH, 1, 2)

    def compressed(self, x_BSKH, kv: str):
        """The compressed keys (``kv="k"``) or values of ``x``, ``[B, C, K, H]``."""
        s = self.settings
        blocks_BCPKH = sparse_blocks.compression_blocks(
            x_BSKH, length=s.compress_block, stride=s.compress_stride
        )
        p = lambda name: getattr(self, f"cmp_{kv}_{name}")[...]
        return sparse_blocks.compress(
            blocks_BCPKH, p("pos_PH"), p("in_PHZ"), p("in_bias_Z"), p("out_ZH")
        )

    def gates(self, x_BTD):
        """``g_t^c`` per head, ``[B, T, N, 3]`` (``BRANCHES`` order)."""
        logits_BTNZ = dense(x_BTD, self.gate_DNZ[...])
        return jax.nn.sigmoid(add_bias(logits_BTNZ, self.gate_bias_NZ[...]))

    def __call__(self, x_BTD, call: MixerCall):
        cfg, s = self.cfg, self.settings
        if call.cache is not None and call.cache.ring is not None:
            raise ConfigError("mixer='nsa' decodes with a linear cache: set no attention window")
        q_BTNH = probe.tap("q", self.query(x_BTD, call))
        dt = q_BTNH.dtype
        spec = sequence_mask(call, x_BTD.shape[1])
        cache, ks_BSKH, vs_BSKH = self.keys_values(x_BTD, call)
        call_c = call if cache is None else call.replace(cache=cache)
        cache, kc_BSKH, vc_BSKH = self.branch_kv(x_BTD, call_c, "cmp")
        call_w = call if cache is None else call.replace(cache=cache)
        cache, kw_BSKH, vw_BSKH = self.branch_kv(x_BTD, call_w, "win")
        S = ks_BSKH.shape[1]
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        flex = dict(
            scale=scale, implementation=flex_implementation(cfg), backend=self.backend,
            block_q=cfg.attention_block_q,
        )  # fmt: skip

        # Compressed: blocks a query may attend whole.
        dense_B1TS = spec.dense()
        allowed_B1TC = sparse_blocks.compression_allowed(
            dense_B1TS, length=s.compress_block, stride=s.compress_stride
        )
        out_cmp_BTNH, probs_BNTC = sparse_blocks.compressed_attention(
            q_BTNH, self.compressed(kc_BSKH, "k"), self.compressed(vc_BSKH, "v"),
            allowed_B1TC, scale=scale,
        )  # fmt: skip

        # Selected: each group's top-n blocks by the compressed probabilities.
        chosen_BNTJ = sparse_blocks.nsa_selection(
            jax.lax.stop_gradient(probs_BNTC), spec.q_pos, S=S, n_kv_heads=cfg.n_kv_heads,
            length=s.compress_block, stride=s.compress_stride, block=s.select_block,
            top_n=s.top_n, local_blocks=s.local_blocks,
        )  # fmt: skip
        probe.record("blocks", chosen_BNTJ)
        mask_BNTS = sparse_blocks.blocks_to_keys(chosen_BNTJ, s.select_block, S) & dense_B1TS
        out_slc_BTNH = ops.flex_attention(
            q_BTNH, ks_BSKH.astype(dt), vs_BSKH.astype(dt), mask=mask_BNTS,
            block_k=s.select_block, **flex,
        )  # fmt: skip

        # Sliding window.
        out_win_BTNH = ops.flex_attention(
            q_BTNH, kw_BSKH.astype(dt), vw_BSKH.astype(dt),
            mask=spec.replace(window=jnp.asarray(s.window, jnp.int32)),
            block_k=cfg.attention_block_k, **flex,
        )  # fmt: skip

        g_BTNZ = self.gates(x_BTD).astype(dt)
        probe.record("gates", g_BTNZ)
        outs_BTNHZ = jnp.stack([out_cmp_BTNH, out_slc_BTNH, out_win_BTNH], axis=-1)
        out_BTNH = jnp.einsum("BTNHZ,BTNZ->BTNH", outs_BTNHZ, g_BTNZ)
        return self.output(probe.tap("z", out_BTNH), x_BTD), cache, None
