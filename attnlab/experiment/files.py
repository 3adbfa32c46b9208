"""Experiment files read and written: ``load_config`` (a file and its dotted overrides),
``to_json`` / ``from_json`` (a config as a work directory saves it), ``flat_keys`` and
``as_namespace``. ``attnlab.experiment`` says what an experiment file is."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing

from ml_collections import config_dict

from attnlab.contracts.ffn import get_ffn
from attnlab.contracts.mixer import get_mixer
from attnlab.errors import ConfigError
from attnlab.experiment.schema import (
    ExperimentError,
    _load_python,
    base_config,
    import_file,
    register_variants,
)

ConfigDict = config_dict.ConfigDict


def _settings_fields(
    base: ConfigDict, overrides, kind="mixer", default="mha", get=get_mixer, group="model"
):
    """Gives ``model.mixer_settings`` every field of the chosen variant's settings (the
    variant an override names, else the experiment's), so ``--config.model.mixer_settings.X``
    overrides work; values the experiment set for that variant are kept. The same for
    ``model.ffn_settings`` with ``kind="ffn_variant"``, and for ``surgery.mixer_settings``
    with ``group="surgery"``."""
    if group not in base:
        return
    node = base[group]
    field = f"{kind.split('_')[0]}_settings"
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith(f"--config.{group}.{kind}=")]
    name = chosen[-1] if chosen else node.get(kind, default)
    try:
        fields = dataclasses.asdict(get(name).Settings())
    except ConfigError:
        return  # unregistered (or no variant): the config's validation says so
    given = node.get(field) or {}
    given = given.to_dict() if isinstance(given, ConfigDict) else dict(given)
    if name == node.get(kind, default):
        fields.update(given)
    with base.unlocked():
        node[field] = ConfigDict(fields)


def load_config(
    spec: str, overrides: typing.Sequence[str] = (), imports: typing.Sequence = ()
) -> ConfigDict:
    """Loads ``path.py[:variant]`` or a saved ``config.json``, then applies dotted overrides.

    ``overrides`` are ``--config.a.b=v`` strings (ml_collections flag syntax). An experiment
    file is imported once per process and recorded in ``experiment_file``; a saved config
    imports the file it records. ``imports`` are module files imported first
    (``import_file``; ``attnlab train --import FILE``), so the variants they register exist
    when the experiment file runs; they are recorded in ``imports`` (after those a saved
    config records).
    """
    files = [import_file(f).__file__ for f in imports]
    from absl import flags
    from ml_collections import config_flags

    path = pathlib.Path(spec.split(":", 1)[0])
    if not path.exists():
        raise ExperimentError(f"--config: no such file {path}")
    if path.suffix == ".json":  # a resolved config saved in a work directory
        base = from_json(path.read_text())
        register_variants(base)
    else:  # the file is executed once, so the variants it registers are registered once
        module = _load_python(path)
        variant = spec.split(":", 1)[1:]
        known = tuple(getattr(module, "VARIANTS", ("tiny",)))
        if variant and variant[0] not in known:
            raise ExperimentError(
                f"--config {spec}: unknown variant {variant[0]!r}; {path} knows "
                f"{', '.join(repr(v) for v in known)} (or none: --config {path})"
            )
        try:
            base = module.get_config(*variant)
        except ExperimentError:
            raise
        except (TypeError, ValueError) as e:
            raise ExperimentError(f"{spec}: get_config failed: {_clean(e)}") from None
        base.experiment_file = str(path.resolve())
    if files:
        recorded = [f for f in base.get("imports") or () if f not in files]
        with base.unlocked():
            base.imports = tuple(recorded + [str(pathlib.Path(f).resolve()) for f in files])
    _settings_fields(base, overrides)
    _settings_fields(base, overrides, "ffn_variant", "dense", get_ffn)
    _settings_fields(base, overrides, "mixer", "", group="surgery")  # the surgery's new mixer
    argv = ["attnlab"]
    fv = flags.FlagValues()
    for o in overrides:
        if not o.startswith("--config."):
            raise ExperimentError(
                f"unexpected argument {o!r}: overrides look like --config.train.steps=100"
            )
    try:  # defining the flag already applies the overrides to ``base``
        config_flags.DEFINE_config_dict(
            "config", base, flag_values=fv, lock_config=True, sys_argv=argv + list(overrides)
        )
        fv(argv + list(overrides))
        cfg = fv.config
    except (AttributeError, KeyError) as e:
        key = _failing_key(overrides, e)
        raise ExperimentError(f"{key}: unknown config key ({_clean(e)})") from None
    except flags.Error as e:
        raise ExperimentError(f"invalid override: {_clean(e)}") from None
    except (TypeError, ValueError) as e:
        raise ExperimentError(f"invalid override: {_clean(e)}") from None
    return cfg


def _clean(e: BaseException) -> str:
    return str(e).strip("'\"").replace("\\n", " ").replace("\n", " ")


def _failing_key(overrides, error) -> str:
    text = str(error)
    for o in overrides:
        leaf = o.split("=", 1)[0].rsplit(".", 1)[-1]
        if f"'{leaf}'" in text or leaf in text:
            return o.split("=", 1)[0]
    return "--config"


def to_json(cfg: ConfigDict) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


def flat_keys(values: dict, prefix: str = "") -> dict:
    """A nested dict (a config as ``to_json`` writes it) as ``{"model.d_model": 128, ...}``."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def from_json(text: str) -> ConfigDict:
    """Rebuilds a saved config on ``base_config()`` so its field types stay locked."""
    values = json.loads(text)
    base = base_config()
    _merge(base, values, "")
    return base


def _merge(target: ConfigDict, values: dict, prefix: str):
    for key, value in values.items():
        if isinstance(value, dict):
            if key not in target:
                target[key] = ConfigDict()
            _merge(target[key], value, f"{prefix}{key}.")
        else:
            target[key] = value


def as_namespace(group: ConfigDict) -> types.SimpleNamespace:
    return types.SimpleNamespace(**group.to_dict())
