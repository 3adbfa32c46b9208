"""Mixture-of-experts feed-forward, ``ModelConfig(ffn_variant="moe")``.

Each token's router logits ``x W_router (+ b_router)`` pick ``top_k`` of ``n_experts``
experts (``attnlab.ops.moe.route``: softmax or sigmoid scores, optional renormalisation,
DeepSeek's grouped routing and selection bias, a routed scaling factor); each expert is an
FFN of the config's activation (``ModelConfig.ffn``) and width ``d_expert``, run dropless
over the tokens sorted by expert (``jax.lax.ragged_dot``). ``n_shared`` shared experts
(one FFN of width ``d_shared``, by default ``n_shared * d_expert``) see every token, their
output scaled by ``sigmoid(x w)`` with ``shared_gate`` (Qwen2-MoE, Qwen3-Next). The first
``dense_layers`` layers of a stack keep the plain FFN of width ``ModelConfig.d_ff``.

The families: Mixtral and Qwen3-MoE are softmax + renormalised top-k (Qwen3's
``norm_topk_prob``); gpt-oss is the same with ``router_bias``, ``expert_bias`` and
``swiglu_limit`` (each expert's SwiGLU clamped, ``ops.clamped_swiglu`` with
``swiglu_alpha``); DeepSeek-V3 is ``score="sigmoid"``, ``selection_bias``,
``n_group=8, topk_group=4``, ``n_shared=1``, ``routed_scaling=2.5``, ``dense_layers=3``.

Parameters (``E`` experts): ``router_DE`` (``b_router_E``, ``selection_bias_E``),
``w_in_EDF``, ``w_gate_EDF`` (gated activations), ``w_out_EFD`` (``b_in_EF``,
``b_gate_EF``, ``b_out_ED``), and ``shared_in_DF``, ``shared_gate_DF``,
``shared_out_FD`` (``shared_expert_gate_D``). The expert axis is the logical axis
``expert``: on a mesh with an ``expert`` axis the experts are split over it, each device
runs its experts on the tokens routed there and the outputs are summed over the axis.

Named intermediates (``attnlab.nn.probe``, read-only, under ``ffn.``): ``router.logits``
``[B, T, E]``, ``router.choices`` (the chosen experts) and ``router.gates`` (their weights),
``[B, T, top_k]``.

``aux``: ``loss`` (``load_balance_weight`` x the Switch Transformer load-balancing loss +
``z_loss_weight`` x the router z-loss, added to the training objective), the two losses
unweighted, ``tokens_per_expert`` ``[E]`` and ``dropped`` (always 0: dispatch is dropless).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from attnlab import ops
from attnlab.contracts.ffn import FFN, FFNSettings, register_ffn
from attnlab.devices.sharding import current_rules
from attnlab.nn import probe
from attnlab.nn.layers import normal
from attnlab.ops import moe
from attnlab.ops.linear import add_bias, dense
from attnlab.ops.precision import wide


@register_ffn("moe")
class MoE(FFN):
    @dataclasses.dataclass(frozen=True)
    class Settings(FFNSettings):
        n_experts: int = 8
        top_k: int = 2
        d_expert: int | None = None  # each expert's hidden width; None: ModelConfig.d_ff
        score: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
        renormalize: bool = True  # the top-k weights sum to 1
        n_group: int = 1  # DeepSeek's grouped routing: experts in n_group groups...
        topk_group: int = 1  # ...of which each token uses the topk_group best
        selection_bias: bool = False  # a per-expert bias on the scores that choose, not weigh
        routed_scaling: float = 1.0  # multiplies the routed experts' weights
        n_shared: int = 0  # shared experts (one FFN of width n_shared * d_expert)
        d_shared: int | None = None  # the shared FFN's width; None: n_shared * d_expert
        shared_gate: bool = False  # the shared output times sigmoid(x w) (Qwen3-Next)
        dense_layers: int = 0  # a stack's first layers keep the plain FFN (width d_ff)
        router_bias: bool = False  # gpt-oss
        expert_bias: bool = False  # biases inside each expert (gpt-oss)
        swiglu_limit: float | None = None  # gpt-oss: the experts' SwiGLU clamped at this...
        swiglu_alpha: float = 1.702  # ...with this sigmoid gain (ops.clamped_swiglu)
        load_balance_weight: float = 0.01
        z_loss_weight: float = 0.001

        def validate(self, cfg) -> None:
            for name in ("n_experts", "top_k", "n_group", "topk_group"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    self.fail(name, "must be a positive integer")
            for name in ("n_shared", "dense_layers"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    self.fail(name, "must be an integer >= 0")
            if self.d_expert is not None and (
                not isinstance(self.d_expert, int) or self.d_expert < 1
            ):
                self.fail("d_expert", "must be a positive integer, or None for ModelConfig.d_ff")
            if self.d_shared is not None and (
                not isinstance(self.d_shared, int) or self.d_shared < 1
            ):
                self.fail("d_shared", "a positive integer, or None for n_shared * d_expert")
            if (self.d_shared is not None or self.shared_gate) and not self.n_shared:
                self.fail("n_shared", "at least 1 with d_shared or shared_gate set")
            if self.top_k > self.n_experts:
                self.fail("top_k", f"at most n_experts={self.n_experts}")
            if self.score not in moe.SCORES:
                self.fail("score", f"use one of {list(moe.SCORES)}")
            if self.n_experts % self.n_group:
                self.fail("n_group", f"must divide n_experts={self.n_experts}")
            if self.topk_group > self.n_group:
                self.fail("topk_group", f"at most n_group={self.n_group}")
            if self.n_group > 1 and self.top_k > self.topk_group * (self.n_experts // self.n_group):
                self.fail("top_k", "more than the experts of the topk_group groups it may use")
            if self.dense_layers and self.dense_layers >= cfg.stack_layers:
                self.fail("dense_layers", f"fewer than n_layers={cfg.stack_layers}")
            if self.dense_layers and cfg.arch == "encoder_decoder":
                self.fail("dense_layers", "dense first layers are for one stack: use 0 here")
            if self.swiglu_limit is not None:
                if not self.swiglu_limit > 0:
                    self.fail("swiglu_limit", "a positive number (gpt-oss: 7.0), or None")
                if cfg.ffn != "swiglu":
                    self.fail("swiglu_limit", f"clamps a SwiGLU: set ffn='swiglu' (is {cfg.ffn!r})")
            for name in ("load_balance_weight", "z_loss_weight", "routed_scaling"):
                if not getattr(self, name) >= 0:
                    self.fail(name, "must be a number >= 0")

    @classmethod
    def prefix_layers(cls, cfg, settings) -> int:
        return settings.dense_layers

    def __init__(self, cfg, settings: Settings, *, rngs: nnx.Rngs):
        s = settings
        E, D, F = s.n_experts, cfg.d_model, s.d_expert or cfg.d_ff
        std, dtype = cfg.init_std, cfg.param_dtype
        out_std = std / (2 * max(cfg.n_layers, 1)) ** 0.5
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, jnp.dtype(dtype)))
        self.settings = s
        self.kind = cfg.ffn
        gated = ops.activations.is_gated(cfg.ffn)
        self.router_DE = normal(rngs, (D, E), std, dtype)
        self.b_router_E = zeros(E) if s.router_bias else None
        self.selection_bias_E = zeros(E) if s.selection_bias else None
        self.w_in_EDF = normal(rngs, (E, D, F), std, dtype)
        self.w_gate_EDF = normal(rngs, (E, D, F), std, dtype) if gated else None
        self.w_out_EFD = normal(rngs, (E, F, D), out_std, dtype)
        self.b_in_EF = zeros(E, F) if s.expert_bias else None
        self.b_gate_EF = zeros(E, F) if s.expert_bias and gated else None
        self.b_out_ED = zeros(E, D) if s.expert_bias else None
        Fs = (s.d_shared or s.n_shared * F) if s.n_shared else 0
        self.shared_in_DF = normal(rngs, (D, Fs), std, dtype) if Fs else None
        self.shared_gate_DF = normal(rngs, (D, Fs), std, dtype) if Fs and gated else None
        self.shared_out_FD = normal(rngs, (Fs, D), out_std, dtype) if Fs else None
        self.shared_expert_gate_D = normal(rngs, (D,), std, dtype) if s.shared_gate else None

    def route(self, x_TD):
        """``(expert_TA, weight_TA, scores_TE, logits_TE)`` of the flattened tokens."""
        s = self.settings
        logits_TE = dense(x_TD, self.router_DE[...], out_dtype=wide(x_TD))
        if self.b_router_E is not None:
            logits_TE = add_bias(logits_TE, self.b_router_E[...])
        bias = None if self.selection_bias_E is None else self.selection_bias_E[...]
        expert_TA, weight_TA, scores_TE = moe.route(
            logits_TE,
            top_k=s.top_k,
            score=s.score,
            renormalize=s.renormalize,
            selection_bias_E=bias,
            n_group=s.n_group,
            topk_group=s.topk_group,
            scaling=s.routed_scaling,
        )
        return expert_TA, weight_TA, scores_TE, logits_TE

    def _experts(self, x_TD, expert_TA, weight_TA):
        get = lambda p: None if p is None else p[...]
        weights = [get(self.w_in_EDF), get(self.w_out_EFD)]
        weights += [get(self.w_gate_EDF), get(self.b_in_EF), get(self.b_gate_EF)]
        weights += [get(self.b_out_ED)]
        s = self.settings
        glu = None
        if s.swiglu_limit is not None:
            glu = functools.partial(ops.clamped_swiglu, alpha=s.swiglu_alpha, limit=s.swiglu_limit)

        def run(x_TD, expert_TA, weight_TA, w_in, w_out, w_gate, b_in, b_gate, b_out,
                expert_range=None):  # fmt: skip
            return moe.expert_ffn(
                x_TD,
                expert_TA,
                weight_TA,
                w_in,
                w_out,
                kind=self.kind,
                w_gate_EDF=w_gate,
                b_in_EF=b_in,
                b_gate_EF=b_gate,
                b_out_ED=b_out,
                glu=glu,
                expert_range=expert_range,
            )

        mesh = jax.sharding.get_abstract_mesh()
        rules = current_rules() or {}
        n = 1 if mesh.empty or "expert" not in mesh.axis_names else mesh.shape["expert"]
        if n == 1 or rules.get("expert") != "expert" or self.settings.n_experts % n:
            return run(x_TD, expert_TA, weight_TA, *weights)
        E = self.settings.n_experts

        def local(x_TD, expert_TA, weight_TA, *weights):
            first = jax.lax.axis_index("expert") * (E // n)
            y_TD = run(x_TD, expert_TA, weight_TA, *weights, expert_range=(first, E))
            return jax.lax.psum(y_TD, "expert")

        specs = [None if w is None else P("expert") for w in weights]
        return jax.shard_map(
            local,
            in_specs=(P(), P(), P(), *specs),
            out_specs=P(),
            axis_names={"expert"},
        )(x_TD, expert_TA, weight_TA, *weights)

    def __call__(self, x_BTD, *, key=None):
        del key  # no dropout inside the experts
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        expert_TA, weight_TA, scores_TE, logits_TE = self.route(x_TD)
        for name, v_TX in (("logits", logits_TE), ("choices", expert_TA), ("gates", weight_TA)):
            probe.record(f"router.{name}", v_TX.reshape(B, T, -1))  # read-only, [B, T, E|A]
        y_TD = self._experts(x_TD, expert_TA, weight_TA)
        if self.shared_in_DF is not None:
            get = lambda p: None if p is None else p[...]
            shared_TD = ops.feed_forward(
                x_TD,
                self.shared_in_DF[...],
                self.shared_out_FD[...],
                kind=self.kind,
                w_gate_DF=get(self.shared_gate_DF),
            )
            if self.shared_expert_gate_D is not None:
                w_D1 = self.shared_expert_gate_D[...][:, None]
                score_T1 = jax.nn.sigmoid(dense(x_TD, w_D1, out_dtype=wide(x_TD)))
                shared_TD = shared_TD * score_T1.astype(shared_TD.dtype)
            y_TD = y_TD + shared_TD
        s = self.settings
        balance = moe.load_balancing_loss(scores_TE, expert_TA)
        z = moe.router_z_loss(logits_TE)
        aux = {
            "loss": s.load_balance_weight * balance + s.z_loss_weight * z,
            "load_balance": balance,
            "z_loss": z,
            "tokens_per_expert": moe.tokens_per_expert(expert_TA, s.n_experts),
            "dropped": jnp.zeros((), jnp.int32),
        }
        return y_TD.reshape(B, T, D).astype(x_BTD.dtype), aux
