"""Small parameter-owning modules: norms, embeddings, positions, feed-forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnlab import ops
from attnlab.config import ModelConfig
from attnlab.contracts.ffn import FFN, register_ffn
from attnlab.nn import probe
from attnlab.ops.linear import dense
from attnlab.ops.precision import wide


def normal(rngs: nnx.Rngs, shape, std, dtype):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.dtype(dtype)))


class Norm(nnx.Module):
    """LayerNorm or RMSNorm over the last axis, as configured."""

    def __init__(self, cfg: ModelConfig, dim: int, *, rngs: nnx.Rngs, kind: str | None = None):
        del rngs
        self.kind = kind or cfg.norm
        self.eps = cfg.norm_eps
        self.scale_D = nnx.Param(jnp.ones((dim,), jnp.dtype(cfg.param_dtype)))
        self.bias_D = (
            nnx.Param(jnp.zeros((dim,), jnp.dtype(cfg.param_dtype)))
            if self.kind == "layernorm" and cfg.norm_bias
            else None
        )

    def __call__(self, x):
        if self.kind == "rmsnorm":
            return ops.rms_norm(x, self.scale_D[...], eps=self.eps)
        bias = None if self.bias_D is None else self.bias_D[...]
        return ops.layer_norm(x, self.scale_D[...], bias, eps=self.eps)


class Embed(nnx.Module):
    """Token embedding ``[V, D]``; ``attend`` gives tied output logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding_VD = normal(
            rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, cfg.param_dtype
        )

    def __call__(self, ids_BT):
        return jnp.take(self.embedding_VD[...], ids_BT, axis=0)

    def attend(self, x_BTD):
        return dense(x_BTD, self.embedding_VD[...].T, out_dtype=wide(x_BTD))


class LearnedPositions(nnx.Module):
    """A learned table of ``max_len + offset`` absolute positions."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.offset = cfg.position_offset
        self.table_PD = normal(
            rngs, (cfg.max_len + cfg.position_offset, cfg.d_model), cfg.init_std, cfg.param_dtype
        )

    def __call__(self, positions_BT):
        return jnp.take(self.table_PD[...], positions_BT + self.offset, axis=0)


class RelativeBias(nnx.Module):
    """T5's learned bucketed relative-position bias, one table per stack."""

    def __init__(self, cfg: ModelConfig, *, bidirectional: bool, rngs: nnx.Rngs):
        self.bidirectional = bidirectional
        self.max_distance = cfg.relative_max_distance
        self.table_XN = normal(
            rngs, (cfg.relative_buckets, cfg.n_heads), cfg.init_std, cfg.param_dtype
        )

    def __call__(self, q_positions_BT, k_positions_BS):
        return ops.relative_position_bias(
            self.table_XN[...],
            q_positions_BT,
            k_positions_BS,
            bidirectional=self.bidirectional,
            max_distance=self.max_distance,
        )

    def describe(self, q_positions_BT, k_positions_BS):
        """The same bias as an ``ops.PositionBias``, for attention to evaluate per block."""
        return ops.PositionBias.relative(
            self.table_XN[...],
            q_positions_BT,
            k_positions_BS,
            bidirectional=self.bidirectional,
            max_distance=self.max_distance,
        )


@register_ffn("dense")
class FeedForward(FFN):
    """Position-wise FFN, plain (ReLU, GELU) or gated (SwiGLU, GeGLU): ``ffn_variant="dense"``."""

    def __init__(self, cfg: ModelConfig, settings=None, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        out_std = cfg.init_std / (2 * max(cfg.n_layers, 1)) ** 0.5
        self.kind = cfg.ffn
        self.rate = cfg.dropout
        self.w_in_DF = normal(rngs, (D, F), cfg.init_std, cfg.param_dtype)
        self.w_gate_DF = (
            normal(rngs, (D, F), cfg.init_std, cfg.param_dtype)
            if ops.activations.is_gated(cfg.ffn)
            else None
        )
        self.w_out_FD = normal(rngs, (F, D), out_std, cfg.param_dtype)
        zeros = lambda n: nnx.Param(jnp.zeros((n,), jnp.dtype(cfg.param_dtype)))
        self.b_in_F = zeros(F) if cfg.ffn_bias else None
        self.b_out_D = zeros(D) if cfg.ffn_bias else None
        # The activation's learned scalars (xIELU's), as act_<name>.
        self.act_names = tuple(ops.activations.PARAMETERS.get(cfg.ffn, {}))
        for name, init in ops.activations.PARAMETERS.get(cfg.ffn, {}).items():
            value = jnp.asarray(init, jnp.dtype(cfg.param_dtype))
            setattr(self, f"act_{name}", nnx.Param(value))

    def __call__(self, x_BTD, *, key=None):
        get = lambda p: None if p is None else p[...]
        act = {name: getattr(self, f"act_{name}")[...] for name in self.act_names}
        return ops.feed_forward(
            x_BTD,
            self.w_in_DF[...],
            self.w_out_FD[...],
            kind=self.kind,
            w_gate_DF=get(self.w_gate_DF),
            b_in_F=get(self.b_in_F),
            b_out_D=get(self.b_out_D),
            dropout_rate=self.rate,
            key=key,
            hidden_fn=lambda h_BTF: probe.tap("hidden", h_BTF),  # named ffn.hidden
            act_params=act or None,
        )
