"""The teacher and the layer plan of an attention transfer (the ``transfer`` config group).

``transfer.teacher`` is a Hugging Face folder (``config.json`` + ``model.safetensors``,
``attnlab.load_pretrained``) or an attnlab run's work directory (its newest checkpoint,
or ``transfer.teacher_step``). The plan says what each layer becomes: ``transfer.plan``,
one name per layer (``"keep"`` or the teacher's own mixer keeps softmax attention; any
registered mixer, one from ``--import my_variant.py`` included), or else ``transfer.mixer``
(with ``transfer.mixer_settings``) in the layers ``transfer.layers`` selects (a layer
selection: ``index``, ``kind``, ``every``/``positions``; none given: every layer).

``transfer.init``: ``fresh`` (the new mixers as ``build_model`` makes them), ``matching``
(surgery's: parameters of the same name and shape copied, then the mixer's ``inherit``) or
``attention`` (``matching``, and the new mixer must take q, k and v from the teacher's
attention, which fails early when its heads differ from the teacher's).

Every check here runs before the first step and raises one line naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib

import jax
import numpy as np
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.contracts.mixer import get_mixer, make_settings, registered_mixers
from attnlab.errors import ConfigError
from attnlab.nn import surgery

INITS = ("fresh", "matching", "attention")
KEEP = "keep"
FIELD = "transfer"


def _fail(field: str, value, fix: str):
    raise ConfigError(
        f"{FIELD}.{field}={value!r} is invalid: {fix}; set --config.{FIELD}.{field}=..."
    )


@dataclasses.dataclass
class Teacher:
    """The frozen teacher: config, parameters, the tokenizer it was trained with (or None)."""

    cfg: ModelConfig
    params: nnx.State
    tokenizer: object
    where: str
    kind: str  # "hf" or "run"


def is_run(path: pathlib.Path) -> bool:
    return (path / "checkpoints").is_dir()


def teacher_config(group) -> tuple[ModelConfig, str]:
    """The teacher's ``ModelConfig`` from its config alone, and its kind."""
    path = pathlib.Path(str(group.teacher or ""))
    if not group.teacher or not (path / "config.json").is_file():
        _fail("teacher", group.teacher, "a Hugging Face folder or an attnlab run's work directory")
    if is_run(path):
        from attnlab import experiment
        from attnlab.runs.loading import saved_config

        return experiment.model_config(saved_config(path)), "run"
    from attnlab.pretrained.configs import model_config_from_hf

    hf = json.loads((path / "config.json").read_text())
    return model_config_from_hf(hf, dtype="float32", param_dtype="float32"), "hf"


def load_teacher(group) -> Teacher:
    """Loads the teacher named by ``transfer.teacher``."""
    cfg, kind = teacher_config(group)
    path = pathlib.Path(group.teacher)
    tok_file = path / "tokenizer.json"
    if kind == "run":
        from attnlab.runs.loading import load_run

        step = int(group.get("teacher_step", -1))
        run = load_run(path, None if step < 0 else step)
        params = jax.device_get(run.params)
        return Teacher(run.model.cfg, params, run.tokenizer, str(path), kind)
    from attnlab.data.tokenizers import load_tokenizer
    from attnlab.pretrained import load_pretrained

    handle = load_pretrained(path)
    tok = load_tokenizer(tok_file) if tok_file.is_file() else None
    return Teacher(handle.model.cfg, handle.params, tok, str(path), kind)


def _settings(group):
    s = group.get("mixer_settings")
    return s.to_dict() if hasattr(s, "to_dict") else (dict(s) if s else None)


def layer_plan(group, teacher: ModelConfig) -> dict[int, tuple[str, dict | None]]:
    """``{layer: (mixer, settings)}`` of the layers that change (the rest keep the teacher's)."""
    n = teacher.n_layers
    if teacher.arch != "decoder":
        _fail("teacher", group.teacher, f"a decoder (this one is {teacher.arch!r})")
    own = surgery.layer_kind_names(teacher)
    plan = tuple(group.get("plan") or ())
    settings = _settings(group)
    if plan:
        if len(plan) != n:
            _fail("plan", plan, f"one name per layer of the teacher ({n} layers)")
        out = {}
        for i, name in enumerate(plan):
            if name in (KEEP, own[i]):
                continue
            if name not in registered_mixers():
                _fail(
                    "plan",
                    plan,
                    f"'keep' or registered mixers; {name!r} is not one "
                    f"(known: {sorted(registered_mixers())}; --import a file for your own)",
                )
            out[i] = (name, settings if name == group.get("mixer") else None)
        return out
    mixer = group.get("mixer", "")
    if mixer not in registered_mixers():
        _fail("mixer", mixer, f"a registered mixer; known: {sorted(registered_mixers())}")
    layers = surgery.select_from(teacher, group.layers, f"{FIELD}.layers")
    return {i: (mixer, settings) for i in layers}


def student_config(group, teacher: ModelConfig) -> tuple[ModelConfig, dict]:
    """The student's ``ModelConfig`` and its plan; mixer settings are checked on it."""
    plan = layer_plan(group, teacher)
    if group.get("init", "matching") not in INITS:
        _fail("init", group.get("init"), f"one of {INITS}")
    cfg = teacher
    for mixer, settings in sorted(
        set((m, json.dumps(s, sort_keys=True)) for m, s in plan.values())
    ):
        layers = [
            i
            for i, (m, s) in plan.items()
            if m == mixer and json.dumps(s, sort_keys=True) == settings
        ]
        try:
            cfg = surgery.replaced_config(cfg, layers, mixer, json.loads(settings))
        except ConfigError as e:
            raise ConfigError(f"{FIELD}.mixer_settings: {e}".replace("\n", " ")) from None
    if group.get("init") == "attention":
        for mixer, settings in {(m, json.dumps(s)) for m, s in plan.values()}:
            check_takes_attention(teacher, mixer, json.loads(settings))
    return cfg, plan


def check_takes_attention(teacher: ModelConfig, mixer: str, settings) -> None:
    """``init="attention"`` needs the new mixer to take q, k and v from the teacher's
    attention: its parameters (abstract, nothing is computed) must share their names and
    shapes, or its ``inherit`` must fill some from them."""
    N, K, H, D = teacher.n_heads, teacher.n_kv_heads, teacher.head_dim, teacher.d_model
    old = {
        "q_DNH": np.zeros((D, N, H)),
        "k_DKH": np.zeros((D, K, H)),
        "v_DKH": np.zeros((D, K, H)),
        "o_NHD": np.zeros((N, H, D)),
    }
    s = make_settings(mixer, settings)
    cls = get_mixer(mixer)
    cfg = teacher.replace(mixer=mixer, mixer_settings=s, block_pattern=None)
    shapes = nnx.eval_shape(lambda: cls(cfg, s, rngs=nnx.Rngs(0)))
    new = {
        k: np.zeros(v.shape)
        for k, v in nnx.to_pure_dict(nnx.state(shapes)).items()
        if not isinstance(v, dict)
    }
    same = [k for k in ("q_DNH", "k_DKH", "v_DKH") if k in new and new[k].shape == old[k].shape]
    if same or cls.inherit(cfg, s, old, new):
        return
    raise ConfigError(
        f"{FIELD}.init='attention' is invalid for mixer {mixer!r} with {settings or {}}: its "
        f"heads are not the teacher's ({N} query heads, {K} key-value heads of {H}), so "
        "nothing comes from the attention weights; give it the teacher's head count or set "
        f"--config.{FIELD}.init=fresh"
    )


def swap_group(group):
    """The group the swap baseline's student is built from: ``mixer_settings`` with
    ``transfer.swap_settings`` (a JSON object, ``""`` or ``"{}"``: none) laid over them.
    ``'{"window": 0}'`` makes LoLCATs' "swap & finetune" arm: the layer without its window."""
    text = str(group.get("swap_settings") or "").strip()
    try:
        over = json.loads(text) if text else {}
    except json.JSONDecodeError:
        over = None
    if not isinstance(over, dict):
        _fail("swap_settings", text, "a JSON object of mixer settings, e.g. '{\"window\": 0}'")
    if not over:
        return group
    g = copy.deepcopy(group)
    with g.unlocked():
        g.mixer_settings = {**(_settings(group) or {}), **over}
    return g


def swap_config(group, teacher: ModelConfig) -> ModelConfig:
    """The swap baseline's ``ModelConfig``; a setting its mixer lacks fails in one line."""
    swapped = swap_group(group)
    try:
        return student_config(swapped, teacher)[0]
    except ConfigError as e:
        text = str(group.get("swap_settings"))
        raise ConfigError(
            f"{FIELD}.swap_settings={text!r} is invalid for this plan ({e}); set "
            f"--config.{FIELD}.swap_settings='{{}}' to swap in the student's own layer"
        ) from None


def build_student(group, teacher: Teacher, seed: int):
    """``(student_cfg, student_params, plan)``: the teacher with the plan applied."""
    cfg, plan = student_config(group, teacher.cfg)
    init = "fresh" if group.get("init") == "fresh" else "matching"
    current_cfg, params = teacher.cfg, teacher.params
    for mixer, settings in {(m, json.dumps(s, sort_keys=True)) for m, s in plan.values()}:
        layers = [
            i
            for i, (m, s) in plan.items()
            if m == mixer and json.dumps(s, sort_keys=True) == settings
        ]
        current_cfg, params = surgery.replace_mixer(
            current_cfg, params, layers, mixer, json.loads(settings), init=init, seed=seed
        )
    return current_cfg, params, plan


def new_parameters(teacher: Teacher, student_cfg: ModelConfig, params, plan, init: str) -> set:
    """The dotted paths of what attention transfer trains: the replaced layers' mixer
    parameters, less (unless ``init="fresh"``) those the teacher's attention has under the
    same name (LoLCATs: the feature maps and the window factor)."""
    from attnlab.train.lora import path_name

    def mixer_part(name):
        return name.split(".attn.", 1)[1] if ".attn." in name else None

    flat = lambda tree: jax.tree_util.tree_flatten_with_path(tree)[0]
    own = {mixer_part(path_name(p)) for p, _ in flat(teacher.params)} - {None}
    if init == "fresh":
        own = set()
    mask = surgery.layer_mask(student_cfg, params, sorted(plan), part="mixer", broadcast=True)
    out = set()
    for path, m in flat(mask):
        name = path_name(path)
        part = mixer_part(name)
        if part is not None and np.any(m) and part not in own:
            out.add(name)
    return out
