"""Distillation objectives against a frozen teacher that runs in the same program.

The config group ``distill`` weighs the terms of a student's loss (per counted token, as
the cross-entropy)::

    ce * CE(student, targets)                      next-token loss
  + kl * T^2 KL(softmax(t / T) || softmax(s / T))  logits, temperature ``temperature``
  + hidden * mean_l |h_s(l) - h_t(l)|^2            hidden-state alignment (resid_post)
  + attention_mse * sum_l MSE(attn_s(l), attn_t(l))  attention transfer (per layer)

The teacher's intermediates are read through ``attnlab.nn.probe`` (the names of
``attnlab.inspect``): its logits, ``layers.{l}.resid_pre`` (each layer's input),
``layers.{l}.attn.out`` (the mixer's output) and ``layers.{l}.resid_post``, all under
``jax.lax.stop_gradient``: the teacher's parameters are an argument of the step, never
differentiated and never seen by the optimiser. For attention transfer the student runs
with every layer's input replaced by the teacher's (``replace`` patches on ``resid_pre``),
so each student layer's mixer sees exactly what the teacher's did (LoLCATs' stage 1, layer
by layer in one pass), and the loss is the mean squared error of the mixer outputs
(``attention_mse_per_layer``: ``[len(layers)]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from attnlab.errors import ConfigError
from attnlab.nn.probe import Patch, Probe

WEIGHTS = ("ce", "kl", "hidden", "attention_mse")


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """A checked ``distill`` config group (``layers``: those of the MSE and hidden terms;
    empty: every replaced layer, or every layer for ``hidden``)."""

    ce: float = 1.0
    kl: float = 0.0
    hidden: float = 0.0
    attention_mse: float = 0.0
    temperature: float = 1.0
    layers: tuple[int, ...] = ()

    @property
    def needs_teacher(self) -> bool:
        return bool(self.kl or self.hidden or self.attention_mse)


def spec_from(group, field: str = "distill") -> DistillSpec:
    """The group as a ``DistillSpec``; one-line errors name ``{field}.<key>``."""
    group = dict(group or {})
    values = {}
    for k in WEIGHTS:
        v = group.get(k, DistillSpec.__dataclass_fields__[k].default)
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ConfigError(f"{field}.{k}={v!r} is invalid: a weight >= 0 (0: the term is off)")
        values[k] = float(v)
    t = group.get("temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, int | float) or t <= 0:
        raise ConfigError(f"{field}.temperature={t!r} is invalid: a positive number (1: none)")
    if not any(values.values()):
        raise ConfigError(f"{field}: every weight is 0; set --config.{field}.ce=1 (or kl, ...)")
    layers = tuple(int(i) for i in group.get("layers", ()) or ())
    return DistillSpec(**values, temperature=float(t), layers=layers)


def teacher_names(spec: DistillSpec, n_layers: int, mse_layers=()) -> tuple[str, ...]:
    """The teacher intermediates the objective reads."""
    names = []
    if spec.attention_mse:
        names += [f"layers.{i}.resid_pre" for i in range(n_layers)]
        names += [f"layers.{i}.attn.out" for i in mse_layers]
    if spec.hidden:
        names += [f"layers.{i}.resid_post" for i in spec.layers or range(n_layers)]
    return tuple(dict.fromkeys(names))


def teacher_pass(model, tokens_BT, names=()):
    """``(logits_BTV, {name: value})`` of the teacher, gradients stopped."""
    with Probe(names) as p:
        out = model(tokens_BT)
    return jax.lax.stop_gradient((out.logits, dict(p.captured)))


def attention_mse_per_layer(student, tokens_BT, seen: dict, layers, n_layers: int):
    """``[len(layers)]``: each layer's mean squared mixer-output error, the student's
    layers fed the teacher's inputs (``seen``: ``teacher_pass``'s captures)."""
    patches = [
        Patch(f"layers.{i}.resid_pre", "replace", value=seen[f"layers.{i}.resid_pre"])
        for i in range(n_layers)
    ]
    names = [f"layers.{i}.attn.out" for i in layers]
    with Probe(names, patches) as p:
        student(tokens_BT)
    err = lambda i: jnp.mean(
        jnp.square(
            p.captured[f"layers.{i}.attn.out"].astype(jnp.float32)
            - seen[f"layers.{i}.attn.out"].astype(jnp.float32)
        )
    )
    return jnp.stack([err(i) for i in layers])


def kl_sum(student_BTV, teacher_BTV, mask_BT, temperature: float = 1.0):
    """``T^2 sum_tokens KL(p_teacher || p_student)`` at temperature ``T``, masked."""
    t = temperature
    logp_t = jax.nn.log_softmax(teacher_BTV.astype(jnp.float32) / t, -1)
    logp_s = jax.nn.log_softmax(student_BTV.astype(jnp.float32) / t, -1)
    kl_BT = jnp.sum(jnp.exp(logp_t) * (logp_t - logp_s), -1)
    return t * t * jnp.sum(kl_BT * mask_BT)


def objective(
    spec: DistillSpec, student, batch, teacher=None, *, mse_layers=(), n_layers: int = 0, key=None
):
    """``(loss, parts)``: the weighted mean loss per counted token and its terms
    (``parts["ce"]``, ``"kl"``, ``"hidden"``, ``"attention_mse"`` (``[layers]``)).
    ``teacher``: ``(logits, captures)`` of ``teacher_pass`` (None without a teacher term)."""
    tokens, targets = batch["inputs"], batch["targets"]
    mask = batch["loss_mask"].astype(jnp.float32)
    n = jnp.maximum(mask.sum(), 1.0)
    parts, loss = {}, jnp.zeros((), jnp.float32)
    hidden_names = [f"layers.{i}.resid_post" for i in spec.layers or range(n_layers)]
    if spec.ce or spec.kl or spec.hidden:
        with Probe(hidden_names if spec.hidden else ()) as p:
            logits = student(tokens, key=key).logits
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        parts["ce"] = jnp.sum(ce * mask) / n
        loss = loss + spec.ce * parts["ce"]
        if spec.kl:
            parts["kl"] = kl_sum(logits, teacher[0], mask, spec.temperature) / n
            loss = loss + spec.kl * parts["kl"]
        if spec.hidden:
            sq = [jnp.mean(jnp.square(p.captured[k] - teacher[1][k])) for k in hidden_names]
            parts["hidden"] = jnp.mean(jnp.stack(sq))
            loss = loss + spec.hidden * parts["hidden"]
    if spec.attention_mse:
        per = attention_mse_per_layer(student, tokens, teacher[1], mse_layers, n_layers)
        parts["attention_mse"] = per
        loss = loss + spec.attention_mse * jnp.sum(per)
    return loss, parts
