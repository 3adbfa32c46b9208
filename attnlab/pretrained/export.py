"""attnlab models written as Hugging Face checkpoint folders (config.json + model.safetensors).

``hf_config_of(cfg)`` finds the registered family whose config.json describes the model
(``attnlab.pretrained.family``, tried in registration order): each family's writer turns
the ``ModelConfig`` into a config.json dict, which is read back with ``model_config_from_hf``
and kept only when the architecture read back is the model's own (every field that changes
the computation; per-layer windows, RoPE bases, mixers and FFNs compared layer by layer, so
a hybrid stack matches whatever block its config.json reads back as). The tensors are the
family's loading table (``Family.mapping``) run backwards, each rule's ``store``; a parameter
no rule writes stops the export. So whatever ``export_model`` writes, ``load_pretrained`` and
transformers read as the same model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np
import safetensors.numpy
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.config.layer_kinds import stack_plan
from attnlab.contracts.mixer import get_mixer
from attnlab.errors import PretrainedError
from attnlab.nn.mixers.recurrent import RecurrentMixer, RecurrentSettings
from attnlab.nn.parametrization import to_standard
from attnlab.pretrained.configs import model_config_from_hf
from attnlab.pretrained.family import get_family, registered_families
from attnlab.pretrained.loader import layer_groups
from attnlab.pretrained.transforms import TRANSFORMS, split_experts


class ExportError(PretrainedError, ValueError):
    """The model has no supported Hugging Face family, or a parameter has no stored name."""


# Fields that do not change what the model computes (or are compared per layer instead).
_NOT_COMPARED = {
    "dropout",
    "attention_dropout",
    "scan_layers",
    "remat",
    "decode_layers",
    "dtype",
    "param_dtype",
    "init_std",
    "attention_impl",
    "attention_block_q",
    "attention_block_k",
    "context_parallel",
    "context_load_balance",
    "layer_pattern",
    "sliding_window",
    "sliding_window_layers",
    "rope_theta",
    # Compared layer by layer, resolved (``_layer_kinds``).
    "mixer",
    "mixer_settings",
    "ffn_variant",
    "ffn_settings",
    "block_pattern",
}
# Fields only attention layers read (a stack without them keeps no positions but learned
# ones), and those only an FFN with a hidden layer reads.
_ATTENTION_FIELDS = {
    "n_heads", "n_kv_heads", "head_dim", "rotary_dim", "rope_scaling", "attn_bias", "out_bias",
    "qk_norm", "qk_norm_scope", "attn_scale", "attention_fn", "causal",
}  # fmt: skip
_FFN_FIELDS = {"ffn", "d_ff", "ffn_bias"}


def _irrelevant(cfg: ModelConfig) -> set[str]:
    """Fields whose value the configured architecture never reads."""
    out = set()
    if cfg.position != "relative":
        out |= {"relative_buckets", "relative_max_distance"}
    if cfg.position != "sinusoidal":
        out.add("sinusoidal_layout")
    if cfg.position != "rope":
        out.add("rotary_dim")
    if cfg.norm == "rmsnorm":
        out.add("norm_bias")
    if not cfg.qk_norm:
        out.add("qk_norm_scope")
    if cfg.arch == "decoder":
        out |= {"mlm_transform", "n_decoder_layers"}
    settings = getattr(cfg, "ffn_settings", None)
    kinds = stack_plan(cfg, cfg.n_layers).kinds
    experts_only = all(k.ffn_variant == "moe" for k in kinds)
    if getattr(settings, "dense_layers", None) == 0 and not settings.n_shared and experts_only:
        out.add("d_ff")  # every FFN is experts of width d_expert (compared in ffn_settings)
    if all(issubclass(get_mixer(m.mixer), RecurrentMixer) for k in kinds for m in k.mixers):
        out |= _ATTENTION_FIELDS  # no layer attends (Mamba-2)
        if cfg.position == "none":
            out.add("max_len")
    if all(k.ffn_variant == "none" for k in kinds):
        out |= _FFN_FIELDS
    return out


def _ffn_computed(settings, cfg: ModelConfig):
    """FFN settings as far as they change the computation: without training-only loss
    weights, the expert and shared widths resolved."""
    if not hasattr(settings, "load_balance_weight"):
        return settings
    d_expert = settings.d_expert or cfg.d_ff
    d_shared = settings.d_shared or (settings.n_shared * d_expert if settings.n_shared else None)
    return dataclasses.replace(
        settings, load_balance_weight=0.0, z_loss_weight=0.0, d_expert=d_expert, d_shared=d_shared
    )


def _layer_kinds(cfg: ModelConfig) -> list:
    """Each layer's mixers (settings resolved against ``cfg``) and FFN (``_ffn_computed``)."""
    out = []
    for kind in stack_plan(cfg, cfg.n_layers).kinds:
        mixers = tuple((m.mixer, _mixer_computed(m.mixer_settings, cfg)) for m in kind.mixers)
        out.append((mixers, kind.ffn_variant, _ffn_computed(kind.ffn_settings, cfg)))
    return out


def _settings_differences(where: str, a, b) -> list[str]:
    """``where.field=a (read back b)`` for each field two settings differ in."""
    if type(a) is not type(b) or not dataclasses.is_dataclass(a):
        return [f"{where}={a!r} (read back {b!r})"]
    return [
        f"{where}.{f.name}={getattr(a, f.name)!r} (read back {getattr(b, f.name)!r})"
        for f in dataclasses.fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    ]


def _kind_differences(i: int, ours, read) -> list[str]:
    """What layer ``i``'s mixers and FFN (``_layer_kinds``) differ in, field by field."""
    (mixers, ffn, ffn_settings), (read_mixers, read_ffn, read_settings) = ours, read
    names, read_names = [m for m, _ in mixers], [m for m, _ in read_mixers]
    if names != read_names:
        return [f"layer {i} mixers {names} (read back {read_names})"]
    out = []
    for (name, a), (_, b) in zip(mixers, read_mixers, strict=True):
        out += _settings_differences(f"layer {i} {name}", a, b)
    if ffn != read_ffn:
        return [*out, f"layer {i} ffn_variant={ffn!r} (read back {read_ffn!r})"]
    return out + _settings_differences(f"layer {i} ffn_settings", ffn_settings, read_settings)


def _mixer_computed(settings, cfg: ModelConfig):
    """Mixer settings resolved against ``cfg``; a recurrent layer's chunk size and training
    form left out (they change rounding, not the function)."""
    if hasattr(settings, "resolved"):
        settings = settings.resolved(cfg)
    if isinstance(settings, RecurrentSettings):
        settings = dataclasses.replace(settings, chunk_size=64, form="chunked")
    return settings


def differences(ours: ModelConfig, read: ModelConfig) -> list[str]:
    """The fields (and per-layer properties) in which two configs compute differently."""
    skip = _NOT_COMPARED | _irrelevant(ours) | _irrelevant(read)
    out = []
    for f in dataclasses.fields(ModelConfig):
        if not f.init or f.name in skip:
            continue
        a, b = getattr(ours, f.name), getattr(read, f.name)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) and b else a == b
        if not same:
            out.append(f"{f.name}={a!r} (read back {b!r})")
    L = ours.n_layers
    if read.n_layers == L:
        pairs = zip(_layer_kinds(ours), _layer_kinds(read), strict=True)
        out += next((_kind_differences(i, a, b) for i, (a, b) in enumerate(pairs) if a != b), [])
    if ours.layer_windows(L) != read.layer_windows(L):
        out.append(f"windows {ours.layer_windows(L)} (read back {read.layer_windows(L)})")
    thetas, read_thetas = ours.layer_rope_thetas(L), read.layer_rope_thetas(L)
    if ours.position == "rope" and not np.allclose(thetas, read_thetas, rtol=1e-9):
        out.append(f"RoPE bases {thetas} (read back {read_thetas})")
    nope = [theta is None for theta, _ in ours.layer_ropes(L)]
    read_nope = [theta is None for theta, _ in read.layer_ropes(L)]
    if ours.position == "rope" and nope != read_nope:
        out.append(f"NoPE layers {nope} (read back {read_nope})")
    return out


def hf_config_of(cfg: ModelConfig) -> tuple[str, dict]:
    """``(family, config.json dict)`` of the first supported family that describes ``cfg``."""
    misses = {}
    writers = {name: f.write for name, f in registered_families().items() if f.write is not None}
    for family, write in writers.items():
        try:
            hf = write(cfg)
            diff = differences(cfg, model_config_from_hf(hf))
        except (ValueError, KeyError, TypeError) as e:  # the family cannot express it
            diff = [str(e).splitlines()[0]]
        if not diff:
            return family, hf
        misses[family] = diff[:3]
    detail = "; ".join(f"{f}: {', '.join(d)}" for f, d in misses.items())
    raise ExportError(
        f"the model's architecture matches no family export-hf writes (supported: "
        f"{sorted(writers)}); closest differences: {detail}"
    )


def _per_layer_values(model) -> dict[str, np.ndarray]:
    """Every parameter by dotted path, stacked layers split as ``stack.layers.{i}.name``."""
    flat = {
        ".".join(str(p) for p in path): leaf
        for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    groups = layer_groups(flat)
    out = {}
    for name, leaf in flat.items():
        value = np.asarray(leaf.get_value(), np.float32)
        if name not in groups:
            out[name] = value
            continue
        stack, rest, layers = groups[name]
        for r, i in enumerate(layers):
            out[f"{stack}.layers.{i}.{rest}"] = value[r]
    return out


def hf_tensors(model, family: str) -> dict[str, np.ndarray]:
    """The model's parameters under the family's stored names, in its stored layouts."""
    values = _per_layer_values(model)
    n_layers = max((int(m) for m in re.findall(r"\.layers\.(\d+)\.", " ".join(values))), default=-1)
    tensors, written = {}, set()
    mapping = get_family(family).mapping
    for rule in mapping.rules:
        for i in range(n_layers + 1 if any("{i}" in t for t in rule.to) else 1):
            targets = [t.format(i=i) for t in rule.to]
            if not all(t in values for t in targets):
                continue
            arrays = tuple(values[t] for t in targets)
            stored = TRANSFORMS[rule.fn].store(arrays, tuple(a.shape for a in arrays))
            tensors[rule.hf[0].format(i=i)] = np.ascontiguousarray(stored, np.float32)
            written.update(targets)
    left = sorted(set(values) - written)
    if left:
        raise ExportError(f"no {family} tensor name holds attnlab parameter(s) {left[:5]}")
    return split_experts(tensors) if mapping.per_expert else tensors


def export_model(model, out) -> str:
    """Writes ``model`` to the folder ``out`` (config.json, model.safetensors); returns the
    family. ``out`` must be new or empty."""
    model = to_standard(model)  # Hugging Face checkpoints are in the standard form
    family, hf = hf_config_of(model.cfg)
    tensors = hf_tensors(model, family)
    finish = get_family(family).finish
    if finish is not None:
        tensors = finish(tensors, hf)
    out = os.fspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"--out {out} exists and is not an empty folder: choose a new one")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    safetensors.numpy.save_file(
        tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"}
    )
    return family
