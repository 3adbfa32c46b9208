"""A run that starts from another model with surgery applied (the ``surgery`` config group).

``surgery.run`` (a work directory; ``surgery.step``, -1: its newest checkpoint) or
``surgery.pretrained`` (a Hugging Face checkpoint folder) names the source; ``surgery.layers``
selects its layers (``attnlab.nn.surgery.select_from``: ``index``, ``kind``, ``i % every in
positions``), which get ``surgery.mixer`` with ``surgery.mixer_settings``, initialised
``fresh`` (at ``train.seed``) or ``matching`` (``attnlab.nn.surgery.replace_mixer``).

``resolve(cfg)`` gives the config whose ``model`` group is the result (the source's model
with the new ``block_pattern``); the run's ``config.json`` holds it, so ``load_run``, cached
decoding, evaluation and export read an ordinary run and never the source. The experiment's
own ``model`` group must be the source's model, the result, or left unset (the defaults):
anything else is refused, since the source decides the model. ``initial_state`` builds the
state at step 0 from the source's parameters (the tokenizer of a source run is read and
saved with the run); a work directory with a checkpoint resumes from it and never reads the
source's parameters again, nor its config once the source has moved (``resolve`` with the
work directory then takes the model its ``config.json`` saved).
"""

from __future__ import annotations

import copy
import json
import pathlib

from ml_collections import ConfigDict

from attnlab import experiment
from attnlab.config import ModelConfig
from attnlab.contracts.mixer import make_settings, registered_mixers
from attnlab.data.tasks import TOKENIZER_FILE
from attnlab.errors import ConfigError
from attnlab.nn import surgery
from attnlab.runs.checkpoint import Checkpointer
from attnlab.runs.files import CHECKPOINTS, CONFIG_FILE
from attnlab.runs.loading import load_run, saved_config

FIELD = "surgery"


def _fail(field: str, value, fix: str):
    raise ConfigError(
        f"{FIELD}.{field}={value!r} is invalid: {fix}; set --config.{FIELD}.{field}=..."
    )


def active(cfg) -> bool:
    """Whether ``cfg`` starts from a source (``surgery.run`` or ``surgery.pretrained``)."""
    group = cfg.get(FIELD) or {}
    return bool(group.get("run") or group.get("pretrained"))


def _source_config(group) -> ModelConfig:
    """The source's ``ModelConfig``, read from its config alone."""
    if group.run and group.pretrained:
        _fail("pretrained", group.pretrained, "give surgery.run or .pretrained, not both")
    if group.run:
        path = pathlib.Path(group.run)
        if not (path / CONFIG_FILE).is_file():
            _fail("run", group.run, "a work directory that `attnlab train` wrote")
        return experiment.model_config(saved_config(path))
    from attnlab.pretrained.configs import model_config_from_hf

    path = pathlib.Path(group.pretrained)
    if not (path / "config.json").is_file():
        _fail("pretrained", group.pretrained, "a Hugging Face checkpoint folder")
    hf_config = json.loads((path / "config.json").read_text())
    return model_config_from_hf(hf_config, dtype="float32", param_dtype="float32")  # as loaded


def _plan(cfg):
    """``(source ModelConfig, selected layers, resulting ModelConfig)`` of ``cfg``."""
    group = cfg[FIELD]
    if group.init not in surgery.INITS:
        _fail("init", group.init, f"one of {surgery.INITS}")
    source = _source_config(group)
    layers = surgery.select_from(source, group.layers, f"{FIELD}.layers")
    if not group.mixer:
        return source, (), source
    settings = group.mixer_settings.to_dict() if group.mixer_settings else None
    try:
        result = surgery.replaced_config(source, layers, group.mixer, settings)
    except ConfigError as e:
        raise ConfigError(str(e).replace("surgery: mixer=", "surgery.mixer=")) from None
    return source, layers, result


def _model_group(mcfg: ModelConfig):
    """``mcfg`` as an experiment's ``model`` group (the types of ``base_config``'s)."""
    base = experiment.base_config()
    experiment._merge(base.model, json.loads(json.dumps(mcfg.to_dict())), "model.")
    return base.model


def resolve(cfg, workdir=None):
    """``cfg`` with the surgery's result as its ``model`` group (``cfg`` itself without a
    source); the module docstring says which ``model`` groups are accepted. A run that
    began in ``workdir`` (its ``config.json`` holds this surgery) resumes without its source:
    when the source can no longer be read, the saved model is the result."""
    if not active(cfg):
        return cfg
    cfg = _with_all_settings(cfg)
    if workdir is not None and not _readable(cfg[FIELD]):
        saved = _begun(cfg, pathlib.Path(workdir))
        if saved is not None:
            return saved
    source, _, result = _plan(cfg)
    given = experiment.model_config(cfg)
    if given not in (ModelConfig(), source, result):
        ref = source.to_dict()
        diff = next(k for k, v in given.to_dict().items() if v != ref.get(k))
        source_field = "run" if cfg[FIELD].run else "pretrained"
        raise ConfigError(
            f"model.{diff}={getattr(given, diff)!r} is invalid: {FIELD}.{source_field} "
            "decides the model (its own, with the surgery applied); leave model as the "
            "source's, or unset"
        )
    if cfg[FIELD].run:
        _source_step(cfg[FIELD])  # checked before the run starts
    with cfg.unlocked():
        cfg.model = _model_group(result)
    return cfg


def _with_all_settings(cfg):
    """A copy of ``cfg`` whose ``surgery.mixer_settings`` hold every field of the new
    mixer's settings (as ``load_config`` gives them), so a config built in Python and one
    loaded with overrides compare equal when a run resumes."""
    out = copy.deepcopy(cfg)
    group = out[FIELD]
    if group.mixer and group.mixer in registered_mixers():
        given = group.mixer_settings.to_dict() if group.mixer_settings else None
        try:
            settings = make_settings(group.mixer, given).to_dict()
        except (ConfigError, TypeError):
            return out  # _plan names the bad setting
        with out.unlocked():
            group.mixer_settings = ConfigDict(settings)
    return out


def _readable(group) -> bool:
    """Whether the source's config (and a run's checkpoints) are where the group says."""
    if group.pretrained:
        return (pathlib.Path(group.pretrained) / "config.json").is_file()
    path = pathlib.Path(group.run)
    return (path / CONFIG_FILE).is_file() and (path / CHECKPOINTS).is_dir()


def _begun(cfg, workdir: pathlib.Path):
    """``cfg`` with the model saved in ``workdir/config.json`` when that run began with the
    same surgery, else None."""
    path = workdir / CONFIG_FILE
    if not path.is_file():
        return None
    saved = experiment.from_json(path.read_text())
    same = lambda c: json.dumps(_with_all_settings(c)[FIELD].to_dict(), sort_keys=True)
    if FIELD not in saved or same(saved) != same(cfg):
        return None
    out = copy.deepcopy(cfg)
    with out.unlocked():
        out.model = saved.model
    return out


def tokenizer_dir(cfg):
    """The source run's directory when it holds a tokenizer (the surgery run reads it), else
    None."""
    run = (cfg.get(FIELD) or {}).get("run")
    if run and (pathlib.Path(run) / TOKENIZER_FILE).is_file():
        return pathlib.Path(run)
    return None


def _source_step(group) -> int | None:
    """The source run's checkpoint to start from (None: its newest), checked to exist."""
    where, steps = pathlib.Path(group.run) / CHECKPOINTS, []
    if where.is_dir():
        with Checkpointer(where) as ckpt:
            steps = sorted(ckpt.all_steps())
    step = int(group.step)
    if not steps or (step >= 0 and step not in steps):
        held = f"{group.run} holds checkpoint steps {steps}; -1: the newest"
        _fail("step", step, f"a checkpoint of the source run ({held})")
    return None if step < 0 else step


def _source_params(group):
    """The source's parameters (an ``nnx.State``)."""
    if group.pretrained:
        from attnlab.pretrained import load_pretrained

        return load_pretrained(group.pretrained).params
    return load_run(group.run, _source_step(group)).params


def initial_state(cfg, trainer):
    """The train state at step 0 of a surgery run: the source's parameters with the surgery
    applied (``trainer`` is the resolved config's); prints one line saying what was done."""
    group = cfg[FIELD]
    source, layers, result = _plan(cfg)
    if result != trainer.mcfg:
        raise ConfigError(
            f"{FIELD}: the config's model is not the surgery's result; pass the config "
            "through attnlab.runs.surgery_run.resolve first"
        )
    # Through replace_mixer even when nothing is replaced: the parameters come out in the
    # layout (and with the variables) of the model the trainer builds.
    mixer = group.mixer or source.mixer
    settings = group.mixer_settings.to_dict() if group.mixer and group.mixer_settings else None
    _, params = surgery.replace_mixer(
        source,
        _source_params(group),
        layers,
        mixer,
        settings,
        init=group.init,
        seed=int(cfg.train.seed),
    )
    where = group.run or group.pretrained
    what = f"layers {list(layers)} -> {group.mixer} ({group.init})" if group.mixer else "as it is"
    print(f"surgery: starting from {where}, {what}", flush=True)
    return trainer.state_around(params)
