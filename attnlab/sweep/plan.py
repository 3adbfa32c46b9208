"""From a sweep specification to validated trial configs, vmap groups and shell commands.

``plan_sweep(config, overrides, spec)`` loads the experiment (``path.py[:variant]`` plus
``--config.k=v`` overrides), applies each trial's overrides on top with the config's locked
types, validates every trial config and fails with an ``ExperimentError`` naming the trial and
the key before anything runs. ``sweep.search.load_sweep`` takes the spec from the experiment file's
``sweep(variant=None)``.

``group_trials`` puts trials whose configs differ only in ``attnlab.runs.STACKABLE`` values
into one group trained by one stacked program (vmapped, or mapped on CPU); every other trial
(one that changes shapes or the traced program) runs on its own.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from attnlab import experiment, runs
from attnlab.experiment import ConfigDict, ExperimentError
from attnlab.runs import surgery_run as surgery
from attnlab.sweep.spec import as_trials, format_value, trial_name

PARALLEL = ("vmap", "sequential")


@dataclasses.dataclass(frozen=True)
class Trial:
    name: str
    overrides: dict[str, Any]
    cfg: ConfigDict


@dataclasses.dataclass(frozen=True)
class Plan:
    config: str  # the experiment, as given to --config
    base_overrides: tuple[str, ...]  # --config.k=v flags shared by every trial
    trials: tuple[Trial, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    mode: str  # "vmap" or "sequential"
    trials: tuple[Trial, ...]
    shared: dict[str, Any]  # the overrides (outside STACKABLE) every trial of the group has

    def describe(self) -> str:
        what = ",".join(f"{k}={format_value(v)}" for k, v in sorted(self.shared.items()))
        names = ", ".join(t.name for t in self.trials)
        return f"{self.mode}, {len(self.trials)} trial(s) [{what or 'base'}]: {names}"


def plan_sweep(config: str, overrides: Sequence[str], spec, *, max_trials=None) -> Plan:
    """Validated trial configs of ``spec`` (a list of override dicts) on the experiment."""
    trials = as_trials(spec)
    if max_trials is not None:
        if isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials <= 0:
            raise ExperimentError(f"--max-trials={max_trials!r} must be a positive integer")
        trials = trials[:max_trials]
    base = experiment.load_config(config, list(overrides))
    planned = []
    for values in trials:
        name = trial_name(values)
        try:
            cfg = surgery.resolve(apply_overrides(base, values))  # a surgery's model
            experiment.validate(cfg)
        except ExperimentError as e:
            raise ExperimentError(f"sweep trial {name}: {e}") from None
        planned.append(Trial(name, dict(values), cfg))
    return Plan(config, tuple(overrides), tuple(planned))


def apply_overrides(base: ConfigDict, overrides: Mapping[str, Any]) -> ConfigDict:
    """A copy of ``base`` with dotted ``overrides`` set; unknown keys and wrong types fail."""
    cfg = copy.deepcopy(base)
    for key, value in overrides.items():
        *groups, leaf = key.split(".")
        node = cfg
        for g in groups:
            if not isinstance(node, ConfigDict) or g not in node:
                raise ExperimentError(f"{key}: unknown config key (no group {g!r})")
            node = node[g]
        if not isinstance(node, ConfigDict) or leaf not in node:
            raise ExperimentError(f"{key}: unknown config key")
        current = node[leaf]
        if isinstance(current, ConfigDict):
            raise ExperimentError(f"{key} is a group of keys, not a value")
        if current is not None and isinstance(value, bool) != isinstance(current, bool):
            raise ExperimentError(
                f"{key}={value!r} has the wrong type: the config holds "
                f"{type(current).__name__} ({current!r})"
            )
        try:
            setattr(node, leaf, value)
        except TypeError:
            kind = type(current).__name__ if current is not None else "another type"
            raise ExperimentError(
                f"{key}={value!r} has the wrong type: the config holds {kind}"
            ) from None
    return cfg


def group_trials(trials: Sequence[Trial], parallel: str = "vmap") -> list[Group]:
    """vmap groups of trials that share array shapes and program; sequential groups otherwise."""
    if parallel not in PARALLEL:
        raise ExperimentError(f"--parallel={parallel!r}: use one of {list(PARALLEL)}")
    if parallel == "sequential":
        return [Group("sequential", (t,), _shared([t])) for t in trials]
    buckets: dict[str, list[Trial]] = {}
    for t in trials:
        buckets.setdefault(runs.stack_key(t.cfg), []).append(t)
    return [
        Group("vmap" if len(ts) > 1 else "sequential", tuple(ts), _shared(ts))
        for ts in buckets.values()
    ]


def _shared(trials):
    first = trials[0].overrides
    return {
        k: v
        for k, v in first.items()
        if k not in runs.STACKABLE and all(t.overrides.get(k, object()) == v for t in trials)
    }


def train_argv(plan: Plan, trial: Trial, workdir) -> list[str]:
    """``attnlab train`` arguments that run ``trial`` alone in ``workdir``."""
    mine = {f"--config.{k}" for k in trial.overrides}
    base = [o for o in plan.base_overrides if o.split("=", 1)[0] not in mine]
    flags = [f"--config.{k}={format_value(v)}" for k, v in sorted(trial.overrides.items())]
    return ["attnlab", "train", "--config", plan.config, *base, *flags, "--workdir", str(workdir)]


def commands(plan: Plan, workdir) -> list[str]:
    """One shell-quoted ``attnlab train`` line per trial, into ``workdir/<trial>``."""
    root = pathlib.Path(workdir)
    return [shlex.join(train_argv(plan, t, root / t.name)) for t in plan.trials]
