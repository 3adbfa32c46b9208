"""Sweep specifications: lists of override dicts, written by hand or built by the helpers here.

A trial is a dict of dotted config keys to plain values (``{"optim.learning_rate": 1e-3}``);
a sweep is a list of trials. ``grid`` takes the cartesian product of value lists,
``random_search`` samples distributions (``log_uniform``, ``uniform``, ``choice``) with a
fixed seed, ``product`` combines sweeps, and Python's ``+`` concatenates them. Every helper
checks its arguments and raises ``ExperimentError`` naming the offending key.

``trial_name`` gives each trial a stable, filesystem-safe directory name derived from its
overrides (sorted by key), with a short hash of the overrides when the readable form had to
be shortened or sanitised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnlab.experiment import ExperimentError

SCALARS = (bool, int, float, str)
MAX_NAME = 96
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


# Distributions -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LogUniform:
    low: float
    high: float

    def sample(self, rng: np.random.Generator) -> float:
        return _round(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))


@dataclasses.dataclass(frozen=True)
class Uniform:
    low: float
    high: float

    def sample(self, rng: np.random.Generator) -> float:
        return _round(rng.uniform(self.low, self.high))


@dataclasses.dataclass(frozen=True)
class Choice:
    options: tuple

    def sample(self, rng: np.random.Generator):
        return self.options[int(rng.integers(len(self.options)))]


DISTRIBUTIONS = (LogUniform, Uniform, Choice)


def _round(x: float) -> float:
    """Four significant digits: readable trial names, values that print and parse exactly."""
    return float(f"{x:.4g}")


def log_uniform(low: float, high: float) -> LogUniform:
    """Values whose logarithm is uniform in ``[log low, log high]`` (learning rates)."""
    if not (isinstance(low, int | float) and isinstance(high, int | float) and 0 < low < high):
        raise ExperimentError(f"log_uniform({low!r}, {high!r}): need 0 < low < high")
    return LogUniform(float(low), float(high))


def uniform(low: float, high: float) -> Uniform:
    if not (isinstance(low, int | float) and isinstance(high, int | float) and low < high):
        raise ExperimentError(f"uniform({low!r}, {high!r}): need low < high")
    return Uniform(float(low), float(high))


def choice(options: Sequence) -> Choice:
    """One of ``options``, each equally likely."""
    options = tuple(options) if _is_sequence(options) else ()
    if not options:
        raise ExperimentError(f"choice({options!r}): need a non-empty list of values")
    return Choice(tuple(_plain("choice", v) for v in options))


# Builders ------------------------------------------------------------------------------------
def grid(space: Mapping[str, Sequence]) -> list[dict]:
    """Every combination of the listed values; the last key varies fastest."""
    _check_space("grid", space)
    for key, values in space.items():
        if not _is_sequence(values) or not len(values):
            raise ExperimentError(f"grid: {key} needs a non-empty list of values, got {values!r}")
    keys = list(space)
    values = [[_plain(k, v) for v in space[k]] for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def random_search(space: Mapping[str, Any], num_trials: int, seed: int = 0) -> list[dict]:
    """``num_trials`` draws from ``space`` (distributions or fixed values), reproducibly.

    Draws are made key by key in the order of ``space`` from ``np.random.default_rng(seed)``;
    continuous values are rounded to four significant digits.
    """
    _check_space("random_search", space)
    if isinstance(num_trials, bool) or not isinstance(num_trials, int) or num_trials <= 0:
        raise ExperimentError(f"random_search: num_trials={num_trials!r} must be a positive int")
    for key, dist in space.items():
        if _is_sequence(dist):
            raise ExperimentError(
                f"random_search: {key} is a list; wrap it in attnlab.sweep.choice([...])"
            )
        if not isinstance(dist, DISTRIBUTIONS):
            _plain(key, dist)
    rng = np.random.default_rng(seed)
    trials = []
    for _ in range(num_trials):
        trials.append(
            {
                k: d.sample(rng) if isinstance(d, DISTRIBUTIONS) else _plain(k, d)
                for k, d in space.items()
            }
        )
    return trials


def product(*sweeps: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Every combination of one trial from each sweep, merged (a key may appear in one only)."""
    if not sweeps:
        raise ExperimentError("product: needs at least one sweep")
    parts = [as_trials(s) for s in sweeps]
    out = []
    for combo in itertools.product(*parts):
        merged: dict = {}
        for trial in combo:
            for key, value in trial.items():
                if key in merged:
                    raise ExperimentError(f"product: {key} is set by more than one sweep")
                merged[key] = value
        out.append(merged)
    return out


def as_trials(spec) -> list[dict]:
    """Checks a sweep specification and returns its trials as plain dicts (numpy -> Python)."""
    if isinstance(spec, Mapping) or not _is_sequence(spec):
        raise ExperimentError(
            f"a sweep is a list of override dicts (or grid(...)/random_search(...)), "
            f"got {type(spec).__name__}"
        )
    trials = []
    for i, trial in enumerate(spec):
        if not isinstance(trial, Mapping):
            raise ExperimentError(f"sweep trial {i} is {trial!r}, not a dict of overrides")
        clean = {}
        for key, value in trial.items():
            if not isinstance(key, str) or not _KEY.match(key):
                raise ExperimentError(
                    f"sweep trial {i}: {key!r} is not a dotted config key (optim.learning_rate)"
                )
            clean[key] = _plain(key, value)
        trials.append(clean)
    if not trials:
        raise ExperimentError("the sweep has no trials")
    names: dict[str, dict] = {}
    for trial in trials:
        name = trial_name(trial)
        if name in names:
            raise ExperimentError(f"the sweep lists the trial {name} twice")
        names[name] = trial
    return trials


# Names ---------------------------------------------------------------------------------------
def format_value(value) -> str:
    """The text of a value as a ``--config.k=v`` flag reads it back."""
    return repr(value) if isinstance(value, float) else str(value)


def trial_name(overrides: Mapping[str, Any]) -> str:
    """``optim.learning_rate=0.001,train.seed=1``: keys sorted, unsafe characters replaced.

    A hash of the overrides is appended when a character was replaced or the name had to be
    cut to ``MAX_NAME`` characters, so distinct trials keep distinct names.
    """
    if not overrides:
        return "base"
    items = sorted(overrides.items())
    readable = ",".join(f"{k}={_UNSAFE.sub('_', format_value(v))}" for k, v in items)
    exact = ",".join(f"{k}={format_value(v)}" for k, v in items)
    if readable == exact and len(readable) <= MAX_NAME:
        return readable
    canonical = json.dumps([[k, v] for k, v in items], sort_keys=True)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:8]
    return f"{readable[: MAX_NAME - 9]}-{digest}"


# Helpers -------------------------------------------------------------------------------------
def _is_sequence(x) -> bool:
    return isinstance(x, Sequence | np.ndarray) and not isinstance(x, str | bytes)


def _check_space(what, space):
    if not isinstance(space, Mapping) or not space:
        raise ExperimentError(f"{what}: needs a non-empty dict of config keys, got {space!r}")
    for key in space:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ExperimentError(f"{what}: {key!r} is not a dotted config key")


def _plain(key, value):
    """A Python scalar (numpy scalars converted) or a tuple of names and dicts; None and other
    containers are refused."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None:
        raise ExperimentError(
            f"{key}=None cannot be written as a --config flag; give the explicit value"
        )
    if isinstance(value, tuple | list) and all(isinstance(v, str | Mapping) for v in value):
        return tuple(value)  # the items of a tuple key: a block pattern's layer kinds
    if not isinstance(value, SCALARS):
        raise ExperimentError(
            f"{key}={value!r}: sweep values must be bool, int, float, str or a tuple of "
            "names and dicts (model.block_pattern.block)"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ExperimentError(f"{key}={value!r}: sweep values must be finite")
    return value
