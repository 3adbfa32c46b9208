"""Mixture-of-experts maths: routing, the auxiliary losses and dropless dispatch.

Letters beyond ``attnlab.dims``: ``E`` experts, ``A`` top-k assignments per token (``k``),
``Z`` assignments in total (tokens x k), ``M`` expert groups (DeepSeek's ``n_group``).
Tokens are flattened to one axis ``T`` here.

Routing (``route``): scores are ``softmax`` or ``sigmoid`` of the router logits; the top-k
experts are chosen from the scores plus an optional selection bias (DeepSeek-V3's
``e_score_correction_bias``, which changes the choice, never the weights), optionally only
within the ``topk_group`` best of ``n_group`` groups (a group's score is the sum of its two
best biased scores); the weights are the chosen experts' scores, renormalised to sum to 1
when asked, times ``scaling`` (DeepSeek's ``routed_scaling_factor``).

Dispatch is dropless: the ``Z = T x k`` assignments are sorted by expert and each expert's
contiguous rows go through its weights with one ``jax.lax.ragged_dot`` per projection, so
no capacity is set and no token is dropped. ``expert_range`` restricts the work to a slice
of the experts (one device's, under expert parallelism): other experts' rows come out zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlab.ops.activations import activation, is_gated
from attnlab.ops.precision import upcast

SCORES = ("softmax", "sigmoid")


def router_scores(logits_TE, score: str):
    logits_TE = upcast(logits_TE)
    if score == "softmax":
        return jax.nn.softmax(logits_TE, axis=-1)
    if score == "sigmoid":
        return jax.nn.sigmoid(logits_TE)
    raise ValueError(f"unknown router score {score!r}; use one of {SCORES}")


def _group_mask(choice_TE, n_group: int, topk_group: int):
    """True for the experts of each token's ``topk_group`` best groups (DeepSeek-V3)."""
    T, E = choice_TE.shape
    grouped_TMe = choice_TE.reshape(T, n_group, E // n_group)
    group_TM = jax.lax.top_k(grouped_TMe, min(2, E // n_group))[0].sum(-1)
    _, best_TA = jax.lax.top_k(group_TM, topk_group)
    keep_TM = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], best_TA].set(True)
    return jnp.repeat(keep_TM, E // n_group, axis=1)


def route(
    logits_TE,
    *,
    top_k: int,
    score: str = "softmax",
    renormalize: bool = True,
    selection_bias_E=None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
):
    """``(expert_TA, weight_TA, scores_TE)``: each token's chosen experts (best first),
    their combine weights and every expert's score (see the module docstring)."""
    scores_TE = router_scores(logits_TE, score)
    choice_TE = scores_TE
    if selection_bias_E is not None:
        bias_E = jax.lax.stop_gradient(selection_bias_E.astype(scores_TE.dtype))
        choice_TE = choice_TE + bias_E[None, :]
    if n_group > 1:
        keep_TE = _group_mask(choice_TE, n_group, topk_group)
        choice_TE = jnp.where(keep_TE, choice_TE, -jnp.inf)
    _, expert_TA = jax.lax.top_k(choice_TE, top_k)
    weight_TA = jnp.take_along_axis(scores_TE, expert_TA, axis=-1)
    if renormalize:
        weight_TA = weight_TA / (weight_TA.sum(-1, keepdims=True) + 1e-20)
    return expert_TA, weight_TA * scaling, scores_TE


def tokens_per_expert(expert_TA, n_experts: int):
    """How many assignments each expert received, ``[E]`` int32."""
    return jnp.bincount(expert_TA.reshape(-1), length=n_experts).astype(jnp.int32)


def load_balancing_loss(scores_TE, expert_TA, valid_T=None):
    """Switch Transformer's ``E * sum_e f_e P_e``: ``f_e`` the fraction of the assignments
    that went to expert ``e`` (for k = 1, of the tokens), ``P_e`` the mean router
    probability of ``e`` (sigmoid scores normalised per token first). 1 when uniform."""
    T, E = scores_TE.shape
    probs_TE = scores_TE / scores_TE.sum(-1, keepdims=True)
    dtype = probs_TE.dtype
    valid_T = jnp.ones((T,), dtype) if valid_T is None else valid_T.astype(dtype)
    n = jnp.maximum(valid_T.sum(), 1.0)
    chosen_TE = jax.nn.one_hot(expert_TA, E, dtype=dtype).sum(1)
    f_E = (chosen_TE * valid_T[:, None]).sum(0) / (n * expert_TA.shape[1])
    p_E = (probs_TE * valid_T[:, None]).sum(0) / n
    return E * jnp.sum(jax.lax.stop_gradient(f_E) * p_E)


def router_z_loss(logits_TE, valid_T=None):
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)^2``."""
    z_T = jax.nn.logsumexp(upcast(logits_TE), axis=-1) ** 2
    if valid_T is None:
        return z_T.mean()
    valid_T = valid_T.astype(z_T.dtype)
    return (z_T * valid_T).sum() / jnp.maximum(valid_T.sum(), 1.0)


def _ragged(x, w, group_sizes, start):
    """``ragged_dot`` over the rows of the experts in ``w`` (a slice of them starting at
    row ``start`` of the sorted assignments); rows outside come out zero."""
    if start is None:
        return jax.lax.ragged_dot(x, w, group_sizes)
    rolled = jnp.roll(x, -start, axis=0)
    return jnp.roll(jax.lax.ragged_dot(rolled, w, group_sizes), start, axis=0)


def expert_ffn(
    x_TD,
    expert_TA,
    weight_TA,
    w_in_EDF,
    w_out_EFD,
    *,
    kind: str,
    w_gate_EDF=None,
    b_in_EF=None,
    b_gate_EF=None,
    b_out_ED=None,
    glu=None,
    expert_range: tuple | None = None,
):
    """``sum_a weight_ta * FFN_{expert_ta}(x_t)``, dropless (sorted rows, ``ragged_dot``).

    ``glu(gate, up)``: the gated unit in place of ``activation(kind)(gate) * up`` (gpt-oss's
    ``clamped_swiglu``); ``b_*``: per-expert biases of the projections.

    ``expert_range=(first, n_experts)`` (``first`` may be traced): the weights hold the
    experts ``first .. first + E_local - 1`` of ``n_experts``; assignments to other
    experts contribute zero (their sum over the devices holding every expert is whole).
    """
    T, A = expert_TA.shape
    E_local = w_in_EDF.shape[0]
    n_experts = E_local if expert_range is None else expert_range[1]
    flat_Z = expert_TA.reshape(-1)
    order_Z = jnp.argsort(flat_Z, stable=True)
    expert_Z = flat_Z[order_Z]
    x_ZD = jnp.take(x_TD, order_Z // A, axis=0)
    sizes_E = jnp.bincount(flat_Z, length=n_experts).astype(jnp.int32)
    start, local_Z = None, None
    if expert_range is not None:
        first = expert_range[0]
        start = jnp.sum(jnp.where(jnp.arange(n_experts) < first, sizes_E, 0))
        sizes_E = jax.lax.dynamic_slice_in_dim(sizes_E, first, E_local)
        local_Z = (expert_Z >= first) & (expert_Z < first + E_local)
        expert_Z = jnp.clip(expert_Z - first, 0, E_local - 1)
    act = activation(kind)

    def project(w, b):
        h_ZF = _ragged(x_ZD, w, sizes_E, start)
        return h_ZF if b is None else h_ZF + jnp.take(b, expert_Z, axis=0).astype(h_ZF.dtype)

    h_ZF = project(w_in_EDF, b_in_EF)
    if is_gated(kind):
        gate_ZF = project(w_gate_EDF, b_gate_EF)
        h_ZF = act(gate_ZF) * h_ZF if glu is None else glu(gate_ZF, h_ZF)
    else:
        h_ZF = act(h_ZF)
    y_ZD = _ragged(h_ZF.astype(x_TD.dtype), w_out_EFD, sizes_E, start)
    if b_out_ED is not None:
        y_ZD = y_ZD + jnp.take(b_out_ED, expert_Z, axis=0).astype(y_ZD.dtype)
    if local_Z is not None:
        y_ZD = jnp.where(local_Z[:, None], y_ZD, 0)
    y_flat = jnp.zeros_like(y_ZD).at[order_Z].set(y_ZD)
    y_TAD = y_flat.reshape(T, A, -1)
    return jnp.einsum("TAD,TA->TD", y_TAD, weight_TA.astype(y_TAD.dtype))
