"""The metric registry: ``register_metric``, the built-ins imported on first use, and what a
run's config selects (``build``, ``check``, ``records``). ``attnlab.metrics`` lists them."""

from __future__ import annotations

import difflib
import importlib
import math

from attnlab.errors import ConfigError
from attnlab.metrics.base import Metric, StepView, flat_record, stack_depth

_BUILTINS = {
    "attn_max_logit": "attnlab.metrics.attn_max_logit",
    "attn_qk_norm": "attnlab.metrics.attn_qk_norm",
    "attn_entropy": "attnlab.metrics.attn_entropy",
    "attn_first_share": "attnlab.metrics.attn_first_share",
    "residual_rms": "attnlab.metrics.residual_rms",
    "residual_max": "attnlab.metrics.residual_max",
    "grad_norms": "attnlab.metrics.grad_norms",
    "update_norms": "attnlab.metrics.update_norms",
    "moe_load_balance": "attnlab.metrics.moe_load_balance",
    "moe_z_loss": "attnlab.metrics.moe_z_loss",
    "moe_router": "attnlab.metrics.moe_router",
    "mtp": "attnlab.metrics.mtp",
    "dsa_indexer": "attnlab.metrics.dsa_indexer",
}
# The built-ins that may join the objective: the keys of ``train.loss_weights``.
LOSS_METRICS = ("moe_load_balance", "moe_z_loss", "mtp", "dsa_indexer")
_CLASSES: dict[str, type[Metric]] = {}


def register_metric(name: str, cls: type[Metric] | None = None, *, overwrite: bool = False):
    """Registers ``cls`` as the metric ``name`` (``train.metrics``); a class decorator too."""

    def add(cls):
        if not (isinstance(cls, type) and issubclass(cls, Metric)):
            raise TypeError(f"register_metric({name!r}): {cls!r} is not a Metric subclass")
        if cls.reduce not in ("mean", "sum", "max") or cls.phase not in ("forward", "update"):
            raise TypeError(
                f"register_metric({name!r}): reduce must be mean/sum/max and phase "
                f"forward/update, got {cls.reduce!r}/{cls.phase!r}"
            )
        if name in _CLASSES and _CLASSES[name] is not cls and not overwrite:
            raise ValueError(f"metric {name!r} exists; pass overwrite=True to replace it")
        cls.name = name
        _CLASSES[name] = cls
        return cls

    return add if cls is None else add(cls)


def registered_metrics() -> dict[str, type[Metric]]:
    """Every registered metric by name (the built-ins included)."""
    for name in _BUILTINS:
        get_metric(name)
    return dict(_CLASSES)


def get_metric(name: str) -> type[Metric]:
    """The metric registered as ``name``; a ``ConfigError`` naming close matches otherwise."""
    if name not in _CLASSES and name in _BUILTINS:
        importlib.import_module(_BUILTINS[name])
    if name not in _CLASSES:
        known = sorted(set(_CLASSES) | set(_BUILTINS))
        close = difflib.get_close_matches(str(name), known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(
            f"train.metrics names {name!r}, which is not a registered metric{hint}; "
            f"use some of {known}"
        )
    return _CLASSES[name]


def selected_names(cfg, mcfg) -> tuple[str, ...]:
    """The metrics a run computes: ``train.metrics`` and those the model implies."""
    train = cfg.get("train", {})
    chosen = train.get("metrics", ()) or ()
    if isinstance(chosen, str):
        chosen = tuple(n.strip() for n in chosen.split(",") if n.strip())
    names = list(dict.fromkeys(chosen))
    for name in _BUILTINS:
        if name not in names and get_metric(name).implied(mcfg):
            names.append(name)
    return tuple(names)


def loss_weight(cfg, mcfg, cls) -> float | None:
    """The weight ``cls`` joins the objective with (None: it never does)."""
    weights = cfg.get("train", {}).get("loss_weights", None) or {}
    given = weights.get(cls.name, None) if hasattr(weights, "get") else None
    if given is None:
        return cls.default_weight(mcfg)
    return float(given)


def check(cfg, mcfg) -> None:
    """Checks ``train.metrics`` and ``train.loss_weights`` against the registry and model."""
    names = selected_names(cfg, mcfg)
    for name in names:
        cls = get_metric(name)
        cls.check(mcfg)
    weights = cfg.get("train", {}).get("loss_weights", None) or {}
    for name in list(weights.keys()) if hasattr(weights, "keys") else []:
        value = weights[name]
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value >= 0):
            raise ConfigError(
                f"train.loss_weights.{name}={value!r} is invalid: use a finite number >= 0; "
                f"set --config.train.loss_weights.{name}=..."
            )
        if get_metric(name).loss_weight is None and get_metric(name).default_weight(mcfg) is None:
            raise ConfigError(
                f"train.loss_weights.{name}: metric {name!r} cannot join the loss; remove "
                f"the weight (losses: {list(LOSS_METRICS)})"
            )


def build(cfg, mcfg, abstract_params=None) -> list[Metric]:
    """The selected metrics, bound to the model and their loss weights."""
    out = []
    for name in selected_names(cfg, mcfg):
        cls = get_metric(name)
        cls.check(mcfg)
        out.append(cls(mcfg, loss_weight(cfg, mcfg, cls), abstract_params))
    return out


def records(metrics, acc_metrics, steps: int) -> dict:
    """A log line's entries from a host copy of ``acc["metrics"]``."""
    out = {}
    for m in metrics:
        if m.name in acc_metrics:
            out.update(m.record(m.window(acc_metrics[m.name], steps)))
    return out


__all__ = [
    "LOSS_METRICS",
    "Metric",
    "StepView",
    "build",
    "check",
    "flat_record",
    "get_metric",
    "records",
    "register_metric",
    "registered_metrics",
    "selected_names",
    "stack_depth",
]
