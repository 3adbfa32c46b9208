"""Multi-token prediction (DeepSeek-V3's sequential MTP modules), ``ModelConfig.mtp_depth``.

Module ``k`` (1..K) reads the previous depth's hidden state and the embedding of the token
``k`` places ahead, and predicts the token ``k + 1`` ahead through the model's own (shared)
embedding and output head::

    h_k[i] = Block_k( RMSNorm(h_{k-1}[i]) W_h,k + RMSNorm(Emb(t[i + k])) W_e,k )
    p_k[i] = Head( Norm_k(h_k[i]) )            -> predicts t[i + k + 1]

``h_0`` is the decoder's last hidden state (what the head reads); ``W_h,k``/``W_e,k`` are
the two halves of DeepSeek-V3's projection of the concatenation ``[RMSNorm(h); RMSNorm(e)]``
(``proj_hidden_DD``, ``proj_embed_DD``); ``Block_k`` is one causal block of the model's
kind. Positions whose token ``i + k`` lies past the sequence see the id 0 (the objective
masks them: ``attnlab.metrics.mtp``). The training loss is ``main + λ mean_k CE_k``;
decoding drafts with the modules (``attnlab.decode.speculative``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from attnlab.contracts.mixer import MixerCall
from attnlab.nn.blocks import Block
from attnlab.nn.layers import Norm, normal
from attnlab.ops.linear import dense, fold


def shifted(x_BT, k: int, fill=0):
    """``x`` moved ``k`` places to the left along time, ``fill`` in the last ``k``."""
    if k == 0:
        return x_BT
    pad = jnp.full(x_BT.shape[:1] + (k,) + x_BT.shape[2:], fill, x_BT.dtype)
    return jnp.concatenate([x_BT[:, k:], pad], axis=1)


class MTPModule(nnx.Module):
    """One depth: the two norms, the projection, a block and the norm before the head."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D = cfg.d_model
        self.hidden_norm = Norm(cfg, D, rngs=rngs, kind="rmsnorm")
        self.embed_norm = Norm(cfg, D, rngs=rngs, kind="rmsnorm")
        self.proj_hidden_DD = normal(rngs, (D, D), cfg.init_std, cfg.param_dtype)
        self.proj_embed_DD = normal(rngs, (D, D), cfg.init_std, cfg.param_dtype)
        self.block = Block(cfg, rngs=rngs)
        self.out_norm = Norm(cfg, D, rngs=rngs)

    def __call__(self, h_BTD, e_BTD, call: MixerCall):
        x_BTD = dense(self.hidden_norm(h_BTD), self.proj_hidden_DD[...])
        x_BTD = x_BTD + dense(self.embed_norm(e_BTD), self.proj_embed_DD[...])
        y_BTD, _, _, _ = self.block(x_BTD, call)
        return y_BTD


class MTP(nnx.Module):
    """The ``mtp_depth`` modules of a decoder, applied in sequence."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.depths = nnx.List([MTPModule(cfg, rngs=rngs) for _ in range(cfg.mtp_depth)])

    def hidden(self, stack, embed, h_BTD, tokens_BT, *, positions_BT=None, segment_ids_BT=None,
               key=None, depths=None):  # fmt: skip
        """``[h_1, ..., h_K]``: each depth's hidden state over the sequence (``tokens_BT``
        the decoder's inputs, ``h_BTD`` its last hidden state); ``depths`` stops early."""
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
        mask, bias, _, _ = stack._self_attention(T, positions_BT, None, segment_ids_BT, None, None)
        out = []
        for k, module in enumerate(self.depths[: depths or len(self.depths)], start=1):
            call = MixerCall(positions_BT=positions_BT, mask=mask, bias=bias,
                             key=fold(key, 2_000_000 + k))  # fmt: skip
            e_BTD = embed(shifted(tokens_BT, k))
            h_BTD = module(h_BTD, e_BTD.astype(h_BTD.dtype), call)
            out.append(h_BTD)
        return out

    def logits(self, head, embed, hidden):
        """Each depth's logits ``[B, T, V]`` from its hidden state (``hidden``)."""
        return [
            head(module.out_norm(h_BTD), embed.tokens)
            for module, h_BTD in zip(self.depths, hidden, strict=False)
        ]
