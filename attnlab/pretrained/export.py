"""attnlab models written as Hugging Face checkpoint folders (config.json + model.safetensors).

``hf_config_of(cfg)`` finds the supported family whose config.json describes the model: each
family's writer turns the ``ModelConfig`` into a config.json dict, which is read back with
``model_config_from_hf`` and kept only when the architecture read back is the model's own
(every field that changes the computation; per-layer windows and RoPE bases compared layer
by layer). The tensors are the family's loading table (``attnlab.pretrained.mappings``) run
backwards, each rule's ``store``; a parameter no rule writes stops the export. So whatever
``export_model`` writes, ``load_pretrained`` and transformers read as the same model.
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
from attnlab.errors import PretrainedError
from attnlab.pretrained.configs import model_config_from_hf
from attnlab.pretrained.export_configs import WRITERS
from attnlab.pretrained.loader import layer_groups
from attnlab.pretrained.mappings_open import MAPPINGS
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
}


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
    if getattr(settings, "dense_layers", None) == 0 and not settings.n_shared:
        out.add("d_ff")  # every FFN is experts of width d_expert (compared in ffn_settings)
    return out


def _computed(cfg: ModelConfig, name: str):
    """Field ``name`` as far as it changes the computation: an FFN variant's settings without
    its training-only loss weights, its expert width resolved."""
    value = getattr(cfg, name)
    if name == "ffn_settings" and hasattr(value, "load_balance_weight"):
        value = dataclasses.replace(
            value, load_balance_weight=0.0, z_loss_weight=0.0, d_expert=value.d_expert or cfg.d_ff
        )
    return value


def differences(ours: ModelConfig, read: ModelConfig) -> list[str]:
    """The fields (and per-layer properties) in which two configs compute differently."""
    skip = _NOT_COMPARED | _irrelevant(ours) | _irrelevant(read)
    out = []
    for f in dataclasses.fields(ModelConfig):
        if not f.init or f.name in skip:
            continue
        a, b = _computed(ours, f.name), _computed(read, f.name)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) and b else a == b
        if not same:
            out.append(f"{f.name}={a!r} (read back {b!r})")
    L = ours.n_layers
    if ours.layer_windows(L) != read.layer_windows(L):
        out.append(f"windows {ours.layer_windows(L)} (read back {read.layer_windows(L)})")
    thetas, read_thetas = ours.layer_rope_thetas(L), read.layer_rope_thetas(L)
    if ours.position == "rope" and not np.allclose(thetas, read_thetas, rtol=1e-9):
        out.append(f"RoPE bases {thetas} (read back {read_thetas})")
    return out


def hf_config_of(cfg: ModelConfig) -> tuple[str, dict]:
    """``(family, config.json dict)`` of the first supported family that describes ``cfg``."""
    misses = {}
    for family, write in WRITERS.items():
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
        f"{sorted(WRITERS)}); closest differences: {detail}"
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
    for rule in MAPPINGS[family].rules:
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
    return split_experts(tensors) if MAPPINGS[family].per_expert else tensors


def export_model(model, out) -> str:
    """Writes ``model`` to the folder ``out`` (config.json, model.safetensors); returns the
    family. ``out`` must be new or empty."""
    family, hf = hf_config_of(model.cfg)
    tensors = hf_tensors(model, family)
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


def export_run(workdir, out, step: int | None = None) -> str:
    """Exports checkpoint ``step`` (default: the newest) of the run in ``workdir``."""
    from attnlab.runs.loading import load_run

    return export_model(load_run(workdir, step).model, out)
