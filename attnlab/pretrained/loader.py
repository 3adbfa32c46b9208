"""Reading a Hugging Face checkpoint folder into an attnlab model.

A folder holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), optionally ``generation_config.json``. Tensors are read
with ``safetensors`` as NumPy arrays (bfloat16 through ``ml_dtypes``); neither torch nor
transformers is needed. The config is translated by ``attnlab.pretrained.configs``, the
model is built abstractly (no random init), and every parameter is filled through the
family's table (its ``Family.mapping``, after its ``prepare``). Any missing, unexpected or
mis-shaped tensor stops the load with an error that names it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.errors import PretrainedError, PretrainedFileError, one_line
from attnlab.nn.models import build_model
from attnlab.pretrained.configs import model_config_from_hf
from attnlab.pretrained.family import family_of, get_family
from attnlab.pretrained.mappings import Mapping
from attnlab.pretrained.transforms import TRANSFORMS, stack_experts


class CheckpointError(PretrainedError):
    """A checkpoint's tensors disagree with its config or with the family's table."""

    def __str__(self):  # KeyError subclasses would otherwise print the message quoted
        return str(self.args[0]) if self.args else ""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the model needs is not in the checkpoint."""


class UnexpectedTensorError(CheckpointError, KeyError):
    """The checkpoint holds tensors the configured model has no place for."""


class TensorShapeError(CheckpointError, ValueError):
    """A stored tensor's shape disagrees with the shape the config implies."""


# Shape letters of parameter names -> the ModelConfig fields that size them.
_LETTER_FIELDS = {
    "D": "d_model",
    "N": "n_heads",
    "K": "n_kv_heads",
    "H": "head_dim",
    "F": "d_ff",
    "V": "vocab_size",
    "P": "max_len + position_offset",
    "X": "relative_buckets",
}

# safetensors dtypes NumPy lacks, decoded from raw bytes.
_RAW_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


# Files -------------------------------------------------------------------------------------


_FETCH = (
    "download the whole folder (config.json, model.safetensors, tokenizer.json), e.g. "
    "`huggingface-cli download NAME --local-dir DIR`"
)


def _folder(path) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise PretrainedFileError(
            f"--pretrained {path}: no checkpoint folder at {path}; pass the folder that holds "
            "config.json and model.safetensors"
        )
    return path


def read_json(path) -> dict:
    if not os.path.isfile(path):
        raise PretrainedFileError(
            f"no {os.path.basename(path)} at {path}: the checkpoint folder is incomplete; {_FETCH}"
        )
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PretrainedFileError(
            f"{path} is not readable JSON ({one_line(e)}); download it again ({_FETCH})"
        ) from None
    if not isinstance(value, dict):
        raise PretrainedFileError(f"{path} holds no JSON object; download it again ({_FETCH})")
    return value


def _read_safetensors(file: str) -> dict[str, np.ndarray]:
    if not os.path.isfile(file):
        raise PretrainedFileError(
            f"no {os.path.basename(file)} at {file}: the checkpoint folder is incomplete; {_FETCH}"
        )
    try:
        return _decode_safetensors(file)
    except PretrainedError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError
        raise PretrainedFileError(
            f"{file} is not a readable safetensors file ({one_line(e)}); it may be cut short: "
            f"download it again ({_FETCH})"
        ) from None


def _decode_safetensors(file: str) -> dict[str, np.ndarray]:
    try:
        with safetensors.safe_open(file, framework="np") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except TypeError:
        pass  # a dtype NumPy lacks (bfloat16, float8): decode the raw buffers below
    with open(file, "rb") as f:
        raw = safetensors.deserialize(f.read())
    out = {}
    for name, view in raw:
        dtype = _RAW_DTYPES.get(view["dtype"])
        if dtype is None:
            raise PretrainedError(f"{file}: tensor {name!r} has unsupported dtype {view['dtype']}")
        out[name] = np.frombuffer(view["data"], dtype).reshape(view["shape"])
    return out


def read_tensors(path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint folder, by stored name (single file or shards)."""
    folder = _folder(path)
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        return _read_safetensors(single)
    if os.path.isfile(index):
        shards = sorted(set(read_json(index)["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(_read_safetensors(os.path.join(folder, shard)))
        return tensors
    raise PretrainedFileError(
        f"no model.safetensors (or model.safetensors.index.json) at {single}: attnlab reads "
        f"safetensors checkpoints only; {_FETCH}"
    )


# Conversion --------------------------------------------------------------------------------


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def _sizes(param: str, shape, cfg: ModelConfig) -> str:
    """``d_model=64, n_heads=4, ...`` for the letters of a parameter's shape suffix."""
    letters = param.rsplit(".", 1)[-1].rsplit("_", 1)[-1]
    if len(letters) != len(shape) or not all(c in _LETTER_FIELDS for c in letters):
        return f"shape {tuple(shape)}"
    values = {
        "D": cfg.d_model,
        "N": cfg.n_heads,
        "K": cfg.n_kv_heads,
        "H": cfg.head_dim,
        "F": cfg.d_ff,
        "V": cfg.vocab_size,
        "P": cfg.max_len + cfg.position_offset,
        "X": cfg.relative_buckets,
    }
    return ", ".join(f"{_LETTER_FIELDS[c]}={values[c]}" for c in letters)


def _with_prefix(tensors: dict, mapping: Mapping) -> dict:
    """Base-model checkpoints lack the task class's wrapper prefix: add it."""
    prefix = mapping.prefix
    if not prefix or any(name.startswith(prefix) for name in tensors):
        return tensors
    return {prefix + name: value for name, value in tensors.items()}


_GROUP = re.compile(r"^(.*)\.(prefix|layers)\.(.*)$")
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.*)$")


def layer_groups(flat: dict) -> dict:
    """``path -> (stack, rest, layers)`` of every stacked parameter ``[n, ...]``: its entry
    ``r`` is layer ``layers[r]`` of the stack, named ``stack.layers.{layers[r]}.rest``. A
    stack's prefix layers (``stack.prefix``, the dense first layers of a mixture of experts)
    come first; position ``p`` of a hybrid block of ``P`` (``stack.layers.blocks.{p}.rest``)
    holds layers ``first + r * P + p``."""
    segments = {}  # (stack, prefix|layers) -> (repeats, block positions)
    for path, leaf in flat.items():
        m = _GROUP.match(path)
        if m:
            b = _BLOCK.match(m[3])
            n, positions = segments.get((m[1], m[2]), (0, set()))
            positions.add(int(b[1]) if b else 0)
            segments[(m[1], m[2])] = (leaf.get_value().shape[0], positions)
    out = {}
    for path, leaf in flat.items():
        m = _GROUP.match(path)
        if not m:
            continue
        first = 0
        if m[2] == "layers" and (m[1], "prefix") in segments:
            n, positions = segments[(m[1], "prefix")]
            first = n * len(positions)
        b = _BLOCK.match(m[3])
        p, rest = (int(b[1]), b[2]) if b else (0, m[3])
        P = len(segments[(m[1], m[2])][1])
        n = leaf.get_value().shape[0]
        out[path] = (m[1], rest, tuple(first + r * P + p for r in range(n)))
    return out


def _per_layer(flat: dict) -> tuple[dict, dict]:
    """Stacked parameters ``stack.layers.p`` ``[L, ...]`` as per-layer shapes
    ``stack.layers.{i}.p`` (the names the tables use); also ``{stack: L}``."""
    shapes, counts = {}, {}
    groups = layer_groups(flat)
    for path, leaf in flat.items():
        shape = tuple(leaf.get_value().shape)
        if path not in groups:
            shapes[path] = shape
            continue
        stack, rest, layers = groups[path]
        counts[stack] = max(counts.get(stack, 0), max(layers) + 1)
        for i in layers:
            shapes[f"{stack}.layers.{i}.{rest}"] = shape[1:]
    return shapes, counts


def _stack_layers(values: dict, flat: dict) -> dict:
    """Per-layer values back into the stacked parameters of ``flat``."""
    out = {}
    groups = layer_groups(flat)
    for path in flat:
        if path not in groups:
            out[path] = values[path]
            continue
        stack, rest, layers = groups[path]
        out[path] = np.stack([values[f"{stack}.layers.{i}.{rest}"] for i in layers])
    return out


def convert(hf_config: dict, tensors: dict[str, np.ndarray], cfg: ModelConfig):
    """The NNX model of ``cfg`` with every parameter taken from ``tensors``."""
    family = get_family(family_of(hf_config))
    mapping = family.mapping
    tensors = stack_experts(_with_prefix(tensors, mapping))
    if family.prepare is not None:
        tensors = family.prepare(tensors, hf_config)
    abstract = nnx.eval_shape(lambda: build_model(cfg))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    flat = {_dotted(path): leaf for path, leaf in nnx.to_flat_state(params)}
    shapes_of, counts = _per_layer(flat)

    values, used = {}, set()
    for rule in mapping.rules:
        templated = [t for t in rule.to if "{i}" in t]
        n = counts.get(templated[0].split(".layers.{i}")[0], 0) if templated else 1
        for i in range(n):
            targets = tuple(t.format(i=i) for t in rule.to)
            present = [t in shapes_of for t in targets]
            if not any(present):
                continue  # this variant of the family is not the configured one
            if not all(present):
                raise RuntimeError(f"mapping rule {rule} only partly matches the model")
            names = [h.format(i=i) for h in rule.hf]
            stored = [name for name in names if name in tensors]
            if not stored:
                raise MissingTensorError(
                    f"the checkpoint lacks tensor {names[0]!r}, which config.json requires "
                    f"(it fills attnlab parameter {targets[0]!r})"
                )
            used.update(stored)
            x = tensors[stored[0]]
            transform = TRANSFORMS[rule.fn]
            shapes = tuple(shapes_of[t] for t in targets)
            expected = tuple(transform.stored_shape(shapes))
            if tuple(x.shape) != expected:
                implied = "; ".join(
                    f"{t} {s} from {_sizes(t, s, cfg)}"
                    for t, s in zip(targets, shapes, strict=True)
                )
                raise TensorShapeError(
                    f"tensor {stored[0]!r} has shape {tuple(x.shape)} but config.json implies "
                    f"{expected} (attnlab parameter {implied})"
                )
            for target, value in zip(targets, transform.apply(x, shapes), strict=True):
                if target in values:
                    raise RuntimeError(f"two mapping rules fill attnlab parameter {target!r}")
                values[target] = value

    unfilled = sorted(set(shapes_of) - set(values))
    if unfilled:
        raise MissingTensorError(
            f"no tensor of the checkpoint fills attnlab parameter(s) {unfilled}"
        )
    unexpected = sorted(
        name
        for name in tensors
        if name not in used and not any(fnmatch.fnmatchcase(name, p) for p in mapping.ignore)
    )
    if unexpected:
        raise UnexpectedTensorError(
            f"the checkpoint holds tensor(s) that config.json gives no place to: {unexpected}"
        )
    values = _stack_layers(values, flat)
    filled = [
        (path, leaf.replace(jnp.asarray(values[_dotted(path)], leaf.get_value().dtype)))
        for path, leaf in nnx.to_flat_state(params)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(filled), rest)


def load_pretrained(path, *, dtype: str = "float32"):
    """Loads a Hugging Face checkpoint folder; returns a ``Pretrained`` handle.

    ``dtype`` is both the parameter and the compute dtype of the attnlab model.
    """
    from attnlab.pretrained.handle import Pretrained

    folder = _folder(path)
    hf_config = read_json(os.path.join(folder, "config.json"))
    cfg = model_config_from_hf(hf_config, dtype=dtype, param_dtype=dtype)
    model = convert(hf_config, read_tensors(folder), cfg)
    generation = os.path.join(folder, "generation_config.json")
    return Pretrained(
        model,
        hf_config=hf_config,
        generation_config=read_json(generation) if os.path.isfile(generation) else {},
        path=folder,
    )
