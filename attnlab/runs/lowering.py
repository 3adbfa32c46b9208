"""``attnlab lower``: an experiment's train step and decode step lowered for a chip, on any
machine, before accelerator hours are spent on it.

    attnlab lower --config experiments/NAME.py[:variant] --platform cuda|tpu
                  [--mesh data=2,fsdp=4] [--config.a.b=v ...] [--import my_variant.py]

The model is built for the platform (``attnlab.ops.paths.target``): every attention call
chooses its path as it would on that chip, and a Pallas kernel is built for the chip, not
run in interpret mode. Both steps are traced on abstract values (nothing is allocated, no
step runs) and lowered with ``lowering_platforms=(platform,)``, which is where Pallas lowers
a kernel for the chip: Mosaic TPU checks its block tiling, the Triton lowering its shapes.
The chip's own compiler (ptxas, the TPU backend) runs only on the chip.

It prints one line per attention call site, naming the layers it stands for and the path it
reaches (``pallas_gpu``, ``pallas_tpu``, ``splash``, ``decode``, ``chunked``, ``xla``...)
with every fallback on the way, and exits 2 with one line per failure: a step that does not
lower, or a layer that falls off the fused kernel ``model.attention_impl`` asks for.

Two routes look at the local device while tracing and cannot be built on another host:
cuDNN's fused attention (``auto``'s choice for plain causal attention on an NVIDIA GPU: the
plan says so and lowers the Pallas kernel in its place) and Tokamax's kernels.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from attnlab.errors import ConfigError, DataError, one_line
from attnlab.ops import paths

PLATFORMS = ("cuda", "rocm", "tpu", "cpu")
# Kernel implementations a config may ask for, by the backend they are built for.
_ASKED_KERNELS = {"gpu": ("pallas_gpu", "tokamax"), "tpu": ("pallas_tpu", "splash")}
# Which ModelConfig field sets a kernel argument named in a fallback line.
_FIELDS = {
    "block_q": "model.attention_block_q",
    "block_k": "model.attention_block_k",
    "q_BTNH: head dim": "model.head_dim",
    "score_mod": "the variant's score function",
}


@dataclasses.dataclass
class Lowered:
    """What ``lower`` found: the attention ``steps`` of each program, ``failures`` (one line
    each), and the lowered modules' text sizes by program."""

    platform: str
    steps: dict[str, list[paths.Step]]
    failures: list[str]
    modules: dict[str, int]
    notes: list[str] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        out = []
        for program, steps in self.steps.items():
            for step in steps:
                out.append(f"{program}: {step}")
        return out


def _layers(names: list[str]) -> str:
    """``layers.0.attn``, ``layers.1.attn`` ... as ``layers.0-3.attn`` (or ``layers.0,2.attn``)."""
    parsed = [re.match(r"^(.*?layers\.)(\d+)(\..*)$", n) for n in names]
    if not names or not all(parsed):
        return ",".join(dict.fromkeys(names)) or "model"
    heads = {(m.group(1), m.group(3)) for m in parsed}
    if len(heads) != 1:
        return ",".join(dict.fromkeys(names))
    (pre, post), idx = heads.pop(), sorted({int(m.group(2)) for m in parsed})
    ranges, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None], strict=True):
        if b != a + 1:
            ranges.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return f"{pre}{','.join(ranges)}{post}"


def _where():
    from attnlab.nn import probe

    active = probe.active()
    if active is None:
        return "model"
    return _layers([n.rsplit(".", 1)[0] for n in active.names_of("attention")])


def _abstract(tree, shardings=None):
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings
    )


def _trace(name, fn, args, platform, record, modules, failures, mesh_ctx):
    """Lowers ``fn(*args)`` for ``platform`` under a probe naming the layers."""
    from attnlab.nn import probe

    with paths.recording(_where) as rec, probe.Probe(), mesh_ctx():
        try:
            lowered = fn.trace(*args).lower(lowering_platforms=(platform,))
            modules[name] = len(lowered.as_text())
        except Exception as e:  # a chip's lowering error, said as one line
            failures.append(f"{name}: does not lower for {platform}: {one_line(e)}")
    record[name] = list(rec.steps)


def train_plan(trainer, batch: dict, batch_size: int) -> list[str]:
    """One line per attention call site of ``trainer``'s train step as it is built here:
    the layers it stands for, the path it reaches and why (``attnlab train --verbose``).
    The step is traced on abstract values shaped like ``batch`` with ``batch_size`` rows;
    nothing runs and no data is read."""
    from attnlab.devices import sharding
    from attnlab.nn import probe

    leaves, treedef = jax.tree.flatten(trainer.abstract_state())
    rows = {k: jax.ShapeDtypeStruct((batch_size, *np.shape(v)[1:]), np.asarray(v).dtype)
            for k, v in batch.items()}  # fmt: skip
    if trainer.mesh is not None:
        rows = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(
            trainer.mesh, trainer.rules, len(v.shape))) for k, v in rows.items()}  # fmt: skip
    step = trainer.flat_train_step(treedef)
    step = getattr(step, "jitted", step)
    ctx = contextlib.nullcontext()
    if trainer.mesh is not None:
        ctx = sharding.activate(trainer.mesh, trainer.rules)
    with paths.recording(_where) as rec, probe.Probe(), ctx:
        step.trace(leaves, rows)
    return [f"train_step: {s}" for s in rec.steps]


def lower(cfg, platform: str, *, mesh=None) -> Lowered:
    """Lowers ``cfg``'s train step and decode step for ``platform`` (see the module
    docstring); ``mesh``: a ``jax.sharding.Mesh`` the steps are sharded over, or None."""
    from attnlab import experiment
    from attnlab.config.architectures import architecture
    from attnlab.data.select import make_task
    from attnlab.decode.compiled import Decoder
    from attnlab.devices import sharding
    from attnlab.kv_cache import init_cache
    from attnlab.train.steps import Trainer

    if platform not in PLATFORMS:
        raise ConfigError(f"--platform {platform!r}: use one of {', '.join(PLATFORMS)}")
    mcfg = experiment.validate(cfg)
    notes = []
    try:
        task = make_task(cfg.data)
    except DataError as e:  # the data is not on this machine: only the batch's shape matters
        if cfg.data.get("kind", "text") != "text" or not cfg.data.get("path"):
            raise
        notes.append(
            f"data: {one_line(e)}; lowered with the embedded corpus in its place (only the "
            "batch's shape enters the program)"
        )
        cfg = copy.deepcopy(cfg)
        cfg.data.path = ""
        task = make_task(cfg.data)
    record, modules, failures = {}, {}, []
    with paths.target(platform) as backend:
        trainer = Trainer(cfg, mcfg, kind=task.kind, mesh=mesh)
        mesh = trainer.mesh

        def on_mesh():
            if mesh is None:
                return contextlib.nullcontext()
            return sharding.activate(mesh, trainer.rules)

        state = trainer.abstract_state()
        leaves, treedef = jax.tree.flatten(state)
        batch = task.train_batch(int(cfg.train.seed), 0, int(cfg.train.batch_size))
        batch_shardings = None
        if mesh is not None:
            batch_shardings = jax.tree.map(
                lambda x: sharding.batch_sharding(mesh, trainer.rules, np.ndim(x)), batch
            )
        step = trainer.flat_train_step(treedef)
        step = getattr(step, "jitted", step)
        args = (leaves, _abstract(batch, batch_shardings))
        _trace("train_step", step, args, platform, record, modules, failures, on_mesh)
        if architecture(mcfg).generates:
            B = int(cfg.train.batch_size)
            decoder = Decoder.for_graph(trainer.graphdef, mcfg)
            cache = jax.eval_shape(lambda: init_cache(mcfg, B, mcfg.max_len))
            if architecture(mcfg).seq2seq:  # the decoder reads the encoded source's keys
                src = jax.ShapeDtypeStruct(np.shape(batch["src"]), jnp.int32)
                valid = jax.ShapeDtypeStruct(np.shape(batch["src"]), jnp.bool_)
                cache = jax.eval_shape(decoder.encode_fn, state["params"], cache, src, valid)
            token = jax.ShapeDtypeStruct((B,), jnp.int32)
            args = (state["params"], cache, token)
            _trace("decode_step", decoder.decode_step, args, platform, record, modules,
                   failures, on_mesh)  # fmt: skip
    asked = mcfg.attention_impl
    for program, steps in record.items():
        for step in steps:
            if asked in _ASKED_KERNELS.get(backend, ()) and not step.kernel:
                failures.append(_failure(program, step, asked))
    return Lowered(platform, record, failures, modules, notes)


def _failure(program, step, asked):
    """One line: where a layer fell off the kernel the config asks for, why, and the fix."""
    why = step.fallbacks[0] if step.fallbacks else f"it reaches {step.path}"
    why = why.split("; falling back")[0]
    field = next((f for arg, f in _FIELDS.items() if why.startswith(arg)), None)
    fix = f"change {field}" if field else "change the call's settings"
    return (
        f"{program}: {step.where}: {asked} (model.attention_impl) cannot take the call: "
        f"{why}; {fix}, or set model.attention_impl='auto' to run {step.path} there"
    )


def parse_mesh(text: str | None) -> dict[str, int]:
    """``data=2,fsdp=4`` as ``{"data": 2, "fsdp": 4}`` (one clear line when malformed)."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise ConfigError(
                f"--mesh {text!r}: write AXIS=SIZE pairs separated by commas, e.g. "
                "data=2,fsdp=4 (axes: data, fsdp, tensor, context, expert)"
            )
        out[name.strip()] = int(size)
    return out


def add_parser(sub, parents):
    p = sub.add_parser(
        "lower",
        parents=parents,
        help="lower an experiment's train and decode steps for a chip (cuda, tpu) on any host",
    )
    p.add_argument(
        "--config", required=True, help="experiments/NAME.py[:variant] or DIR/config.json"
    )
    p.add_argument("--platform", required=True, choices=PLATFORMS)
    p.add_argument(
        "--mesh", default=None, help="AXIS=SIZE,... a mesh of that many (fake CPU) devices"
    )
    p.add_argument("--verbose", action="store_true", help="also print each fallback line")
    p.add_argument("--import", dest="imports", action="append", metavar="FILE.py")
    p.set_defaults(fn=command, overrides=True)


def command(args, overrides) -> int:
    import os
    import sys

    sizes = parse_mesh(args.mesh)
    n = int(np.prod(list(sizes.values()))) if sizes else 1
    if n > 1:  # fake CPU devices (the mesh's count), asked before JAX starts its backends
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                       os.environ.get("XLA_FLAGS", ""))  # fmt: skip
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    from attnlab import experiment
    from attnlab.devices import sharding

    overrides = list(overrides) + [f"--config.mesh.{a}={s}" for a, s in sizes.items()]
    cfg = experiment.load_config(args.config, overrides, imports=args.imports or ())
    mesh = sharding.mesh_from_config(cfg) if n > 1 else None
    result = lower(cfg, args.platform, mesh=mesh)
    for line in result.notes:
        print(line)
    for line in result.lines():
        print(line if args.verbose else line.split("; ")[0])
    for program, size in result.modules.items():
        print(f"{program}: lowered for {args.platform} ({size:,} characters of StableHLO)")
    for line in result.failures:
        print(f"attnlab lower: error: {line}", file=sys.stderr)
    return 2 if result.failures else 0
