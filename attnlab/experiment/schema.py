"""The experiment config's groups, defaults and checks: ``base_config()`` and ``validate``.

``attnlab.experiment`` loads experiment files and overrides on top of these; see its
docstring for the conventions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import pathlib
import sys
import types
import typing

from ml_collections import config_dict

from attnlab.config import ModelConfig
from attnlab.contracts.optimizer import OPTIMIZERS, SCHEDULES, with_rule
from attnlab.contracts.score_function import attention_variants
from attnlab.data.tasks import TASK_KINDS
from attnlab.errors import ConfigError
from attnlab.metrics import LOSS_METRICS
from attnlab.ops.positions import RopeScaling

ConfigDict = config_dict.ConfigDict


class ExperimentError(ConfigError):
    """An experiment config that cannot run; the message names the key and the fix."""


def _rope_scaling_defaults() -> ConfigDict:
    """``model.rope_scaling`` as ``RopeScaling``'s fields (``--config.model.rope_scaling.kind
    =yarn`` ...), each typed; left without a kind it means no scaling."""
    hints = typing.get_type_hints(RopeScaling)
    cfg = ConfigDict()
    for field in dataclasses.fields(RopeScaling):
        value = field.default
        if value is None or value is dataclasses.MISSING:
            args = [a for a in typing.get_args(hints[field.name]) if a is not type(None)]
            kind = args[0] if args else hints[field.name]
            value = config_dict.placeholder(typing.get_origin(kind) or kind)
        setattr(cfg, field.name, value)
    return cfg


def _model_defaults() -> ConfigDict:
    cfg = ConfigDict()
    hints = typing.get_type_hints(ModelConfig)
    for field in dataclasses.fields(ModelConfig):
        if not field.init:
            continue
        value = field.default
        if field.name in ("mixer_settings", "ffn_settings"):  # a variant's own fields
            value = ConfigDict()
        elif field.name == "rope_scaling":  # RopeScaling's fields; kind unset: no scaling
            value = _rope_scaling_defaults()
        elif field.name == "block_pattern":  # kinds as tuples: --config.model.block_pattern.block
            kinds = lambda: config_dict.placeholder(tuple)
            value = ConfigDict({"prefix": kinds(), "block": kinds()})
        elif value is None:  # Optional field: lock its type, keep it unset
            args = [a for a in typing.get_args(hints[field.name]) if a is not type(None)]
            value = config_dict.placeholder(typing.get_origin(args[0]) or args[0])
        setattr(cfg, field.name, value)
    return cfg


def base_config() -> ConfigDict:
    """Every key an experiment accepts, with defaults."""
    c = ConfigDict()
    c.name = "experiment"
    c.experiment_file = ""  # the experiment's .py file (absolute), set by load_config
    # Module files imported before the config was built (``attnlab train --import FILE``),
    # absolute; every process that reopens the run imports them first.
    c.imports = ()
    c.model = _model_defaults()
    c.data = ConfigDict(
        dict(
            kind="text",
            path="",
            tokenizer="char",
            seq_len=128,
            val_fraction=0.1,
            num_symbols=16,
            min_len=1,
            max_len=0,
            mask_rate=0.15,
            max_chars=2_000_000,
            vocab_size=1024,  # of a data.tokenizer="bpe" trained on the corpus
            source="",  # "hf_datasets": data.path is a Hugging Face data set on disk
            text_field="text",  # its column of text
            pipeline="grain",  # packed documents; "index": windows at every offset, stateless
            workers=0,  # Grain worker processes for the packed pipeline (0: a prefetch thread)
            tasks="",  # data.kind="length_task": comma-separated tasks (attnlab.data.length_tasks)
            reverse_sum=False,  # its addition rows: the sum least-significant digit first
        )
    )
    c.optim = ConfigDict(
        dict(
            name="adamw",  # or "muon": matrices by Muon, the rest by Adam
            learning_rate=1e-3,
            adam_learning_rate=3e-3,  # muon only: the Adam-trained parameters' peak rate
            muon_beta=0.95,  # muon only: momentum
            muon_ns_steps=5,  # muon only: Newton-Schulz iterations per orthogonalisation
            warmup_steps=100,
            schedule="cosine",
            min_lr_ratio=0.1,
            decay_fraction=0.1,  # wsd only: the last fraction of the steps decays
            b1=0.9,
            b2=0.99,
            eps=1e-8,
            weight_decay=0.1,
            decay_embeddings=False,
            clip_norm=1.0,
            grad_accum_steps=1,
            # Set by ``attnlab train --extend``: [step, train.steps before] each time the run
            # was trained on to another train.steps (the schedule keeps its shape).
            extended=(),
        )
    )
    c.train = ConfigDict(
        dict(
            steps=1000,
            batch_size=32,
            seed=0,
            log_every_steps=10,
            profile_steps="",
            on_nonfinite="stop",
            # Registered step metrics to compute and log (attnlab.metrics), e.g.
            # ("attn_max_logit", "residual_rms"); those the model implies are always on.
            metrics=(),
        )
    )
    # The weight of each metric that may join the objective (None: its default; 0: observed
    # only): main loss + sum of weight x metric.
    c.train.loss_weights = ConfigDict(
        {name: config_dict.placeholder(float) for name in LOSS_METRICS}
    )
    c.eval = ConfigDict(
        dict(
            every_steps=200,
            batches=8,
            batch_size=32,
            sample_tokens=200,
            sample_prompt="",
            sample_temperature=0.8,
        )
    )
    c.checkpoint = ConfigDict(dict(every_steps=500, max_to_keep=3))
    # The device mesh (attnlab.devices.sharding): one axis may be -1, the remaining devices.
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1, context=1, expert=1))
    c.mesh.rules = ConfigDict()  # logical axis -> mesh axis overrides of sharding.RULES
    # Many hosts: jax.distributed.initialize before anything else. "auto" initialises when
    # a coordinator is given or a multi-task SLURM job is detected; "on" always; "off" never.
    # A coordinator silent for initialization_timeout_s, or a process silent for
    # heartbeat_timeout_s, stops every process with one line (attnlab.devices.processes).
    c.distributed = ConfigDict(
        dict(
            initialize="auto",
            coordinator_address="",
            num_processes=0,
            process_id=-1,
            initialization_timeout_s=300,
            heartbeat_timeout_s=100,
        )
    )
    # Metrics also go to TensorBoard (DIR/tb) and, with a project, to Weights & Biases.
    c.track = ConfigDict(
        dict(tensorboard=True, wandb_project="", wandb_entity="", wandb_mode="offline")
    )
    # Model surgery (attnlab.runs.surgery_run): the run starts from another run's checkpoint
    # (or a Hugging Face checkpoint folder) with ``mixer`` in the selected layers. Applied
    # once, when the work directory has no checkpoint; the model group becomes the result.
    c.surgery = ConfigDict(
        dict(
            run="",  # the source: a work directory that `attnlab train` wrote
            pretrained="",  # or a Hugging Face checkpoint folder (attnlab.load_pretrained)
            step=-1,  # the source run's checkpoint (-1: its newest)
            layers=layer_selection(),  # the layers that get ``mixer``
            mixer="",  # a registered mixer ("": none replaced, the source as it is)
            mixer_settings=ConfigDict(),
            init="fresh",  # or "matching": new mixers start from the old where shapes allow
        )
    )
    # Parameters kept unchanged by the optimiser (attnlab.nn.surgery.freeze): "none", the
    # "selected" layers, or every parameter but the selected layers' ("others").
    c.freeze = ConfigDict(dict(mode="none", layers=layer_selection(), part="layer"))
    # Low-rank adapters (attnlab.train.lora; the group checked by experiment.lora_spec): rank
    # 0 trains the parameters themselves; above 0 they are frozen and adapters of that rank
    # train on the ``targets`` (short names q, k, v, o, ffn, mixer, or globs over parameter
    # paths), the update (alpha / rank) A B.
    c.lora = ConfigDict(dict(rank=0, alpha=16.0, targets=("q", "k", "v", "o"), dropout=0.0))
    return c


def layer_selection() -> ConfigDict:
    """Layers by every criterion given (none: every layer): ``index`` (negative from the
    end), ``kind`` (``attnlab.nn.surgery.layer_kind_names``), and ``i % every in positions``."""
    return ConfigDict(dict(index=(), kind="", every=0, positions=()))


def model_config(cfg: ConfigDict) -> ModelConfig:
    """The ``ModelConfig`` of an experiment; invalid values name ``model.<field>``."""
    register_variants(cfg)
    try:
        return ModelConfig(**cfg.model.to_dict())
    except ValueError as e:
        raise ExperimentError(str(e).replace("ModelConfig.", "model.")) from None


def _require(ok, key, value, fix):
    if not ok:
        raise ExperimentError(f"{key}={value!r} is invalid: {fix}; set --config.{key}=...")


def _real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# (key, test, what the value must be) for every numeric field outside ``model``.
_DOMAINS = [
    ("optim.learning_rate", lambda v: v > 0, "a positive finite number"),
    ("optim.adam_learning_rate", lambda v: v > 0, "a positive finite number"),
    ("optim.muon_beta", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("optim.decay_fraction", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("optim.b1", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("optim.b2", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("optim.eps", lambda v: v > 0, "a positive finite number"),
    ("optim.weight_decay", lambda v: v >= 0, "a finite number >= 0"),
    ("optim.clip_norm", lambda v: v >= 0, "a finite number >= 0 (0 disables clipping)"),
    ("optim.warmup_steps", lambda v: v >= 0, "an integer >= 0"),
    ("data.val_fraction", lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("data.mask_rate", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("data.num_symbols", lambda v: v >= 1, "an integer >= 1"),
    ("data.min_len", lambda v: v >= 1, "an integer >= 1"),
    ("data.max_len", lambda v: v >= 0, "an integer >= 0 (0 = the largest that fits)"),
    ("data.max_chars", lambda v: True, "an integer (<= 0 = no limit)"),
    ("eval.sample_tokens", lambda v: v >= 0, "an integer >= 0 (0 disables samples)"),
    ("eval.sample_temperature", lambda v: v >= 0, "a finite number >= 0 (0 = greedy)"),
]
ON_NONFINITE = ("stop", "skip")


def _check_domains(cfg):
    for key, ok, what in _DOMAINS:
        group, leaf = key.split(".")
        if leaf not in cfg[group]:
            continue
        value = cfg[group][leaf]
        _require(_real(value) and ok(value), key, value, f"must be {what}")


def validate(cfg: ConfigDict) -> ModelConfig:
    """Checks every group; returns the validated ``ModelConfig``."""
    for group in ("model", "data", "optim", "train", "eval", "checkpoint"):
        _require(
            group in cfg,
            group,
            None,
            f"the config has no '{group}' group; build it on attnlab.experiment.base_config()",
        )
    t, o, e, k, d = cfg.train, cfg.optim, cfg.eval, cfg.checkpoint, cfg.data
    _check_domains(cfg)
    _require(
        t.get("on_nonfinite", "stop") in ON_NONFINITE,
        "train.on_nonfinite",
        t.get("on_nonfinite"),
        "use 'stop' (end the run at a non-finite loss) or 'skip' (skip such steps)",
    )
    for key, value in [
        ("train.steps", t.steps),
        ("train.batch_size", t.batch_size),
        ("train.log_every_steps", t.log_every_steps),
        ("eval.every_steps", e.every_steps),
        ("eval.batch_size", e.batch_size),
        ("checkpoint.every_steps", k.every_steps),
        ("checkpoint.max_to_keep", k.max_to_keep),
        ("data.seq_len", d.seq_len),
        ("optim.grad_accum_steps", o.grad_accum_steps),
        ("optim.muon_ns_steps", o.get("muon_ns_steps", 5)),
    ]:
        _require(value > 0, key, value, "must be a positive integer")
    _require(0 <= t.seed < 2**32, "train.seed", t.seed, "must be in [0, 2**32)")
    _require(e.batches >= 0, "eval.batches", e.batches, "must be >= 0 (0 disables evaluation)")
    _require(o.learning_rate > 0, "optim.learning_rate", o.learning_rate, "must be positive")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    _require(o.name in OPTIMIZERS, "optim.name", o.name, f"use one of {sorted(OPTIMIZERS)}")
    _require(
        o.schedule in SCHEDULES,
        "optim.schedule",
        o.schedule,
        f"use one of {sorted(SCHEDULES)} (wsd: warmup-stable-decay)",
    )
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    _require(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    _require(o.clip_norm >= 0, "optim.clip_norm", o.clip_norm, "must be >= 0 (0 disables)")
    _require(
        t.batch_size % o.grad_accum_steps == 0,
        "optim.grad_accum_steps",
        o.grad_accum_steps,
        f"must divide train.batch_size={t.batch_size}",
    )
    _require(d.kind in TASK_KINDS, "data.kind", d.kind, f"use one of {list(TASK_KINDS)}")
    mcfg = model_config(cfg)
    arch_for = {
        "seq2seq_reverse": "encoder_decoder",
        "addition": "encoder_decoder",
        "mlm": "encoder",
        "mlm_text": "encoder",
    }
    want = arch_for.get(d.kind, "decoder")
    rule = OPTIMIZERS[o.name].rule is not None or mcfg.parametrization == "standard"
    _require(
        rule,
        "optim.name",
        o.name,
        f"it has no learning-rate rule for model.parametrization={mcfg.parametrization!r}; "
        f"use one of {with_rule(mcfg.parametrization)} or --config.model.parametrization=standard",
    )
    _require(
        mcfg.arch == want,
        "model.arch",
        mcfg.arch,
        f"data.kind={d.kind!r} trains a {want!r} model; set --config.model.arch={want}",
    )
    _require(
        d.seq_len <= mcfg.max_len,
        "data.seq_len",
        d.seq_len,
        f"exceeds model.max_len={mcfg.max_len}; raise model.max_len or shorten data.seq_len",
    )
    from attnlab import metrics

    metrics.check(cfg, mcfg)  # train.metrics and train.loss_weights, against the model
    if "freeze" in cfg:  # its mode, part and selection, on the model (before any run starts)
        from attnlab.nn import surgery

        surgery.check_freeze(mcfg, cfg.freeze)
    if "lora" in cfg:  # its values, and the groups it cannot go with (its targets: Trainer)
        from attnlab.experiment import lora_spec

        lora_spec.check(cfg)
    return mcfg


_MODULES: dict[tuple[str, int], types.ModuleType] = {}


def _on_path(folder: pathlib.Path) -> None:
    """``folder`` first on ``sys.path`` (as Python puts a script's folder), once."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def import_file(path) -> types.ModuleType:
    """A module file (``attnlab train --import FILE``) imported as a script would import a
    neighbour: its folder first on ``sys.path``, the module named by the file's stem. A file
    that imports it (an experiment file beside it) then gets the same module, so what it
    registers is registered once. A stem taken by another module is refused."""
    path = pathlib.Path(path).resolve()
    if path.suffix != ".py" or not path.is_file():
        raise ExperimentError(f"--import {path}: no such Python file")
    _on_path(path.parent)
    try:
        module = sys.modules.get(path.stem) or importlib.import_module(path.stem)
    except SyntaxError as e:
        raise syntax_error(e, path) from None
    where = getattr(module, "__file__", None)
    if where is None or pathlib.Path(where).resolve() != path:
        raise ExperimentError(
            f"--import {path}: the module name {path.stem!r} is already taken by "
            f"{where or 'a built-in module'}; rename the file"
        )
    return module


def syntax_error(e: SyntaxError, path) -> ExperimentError:
    """The one line of a Python file that does not parse: the file, the line and the error
    (the file that failed: an experiment file may import one beside it)."""
    where = e.filename if e.filename and not e.filename.startswith("<") else str(path)
    return ExperimentError(
        f"{where}, line {e.lineno}: {type(e).__name__}: {e.msg}; fix the file and run the "
        "command again"
    )


def import_experiment(path) -> types.ModuleType:
    """The module of an experiment file, executed once per process (while unchanged).

    Executing it registers the attention variants it defines; a second import of the same
    file returns the same module, so its registrations are not repeated. The file's folder
    is first on ``sys.path`` (``_on_path``), so it imports the files beside it as a script
    would (``from my_variant import MyMixer``).
    """
    path = pathlib.Path(path).resolve()
    key = (str(path), path.stat().st_mtime_ns)
    _on_path(path.parent)
    if key not in _MODULES:
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        name = f"attnlab_experiment_{path.stem}_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(module)
        except SyntaxError as e:  # IndentationError too: the file, the line, the error
            del sys.modules[name]
            raise syntax_error(e, path) from None
        except BaseException:
            del sys.modules[name]
            raise
        _MODULES[key] = module
    return _MODULES[key]


def register_variants(cfg: ConfigDict) -> None:
    """Imports the module files (``imports``) and then the experiment file ``cfg`` records,
    registering their variants.

    A missing module file is skipped (the variant it registers, if the config names one, is
    then reported unregistered); a missing experiment file is an error only when
    ``model.attention_fn`` is not registered otherwise.
    """
    for imported in cfg.get("imports") or ():
        if pathlib.Path(imported).is_file():
            import_file(imported)
    source = cfg.get("experiment_file") or ""
    if source and pathlib.Path(source).exists():
        import_experiment(source)
        return
    name = cfg.model.get("attention_fn") if "model" in cfg else None
    if source and name is not None and name not in attention_variants():
        raise ExperimentError(
            f"model.attention_fn={name!r} is registered by the experiment file {source}, "
            "which no longer exists; restore the file, or set experiment_file in config.json "
            "to the file that registers it"
        )


def _load_python(path: pathlib.Path):
    module = import_experiment(path)
    if not hasattr(module, "get_config"):
        raise ExperimentError(f"{path} defines no get_config(variant=None) function")
    return module
