"""Which path an attention call takes: the platform it is compiled for, the fallback log and
the plan of a traced program.

**The target platform.** ``backend`` in ``flex_attention`` / ``dot_product_attention`` names
the platform the program is compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``), not the host it
is traced on: ``backend="gpu", interpret=False`` builds the GPU kernel on any host, so the
program can be lowered for CUDA from a laptop
(``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))``) but runs only on a GPU.
Models take the platform they are built for from ``backend()``: JAX's default backend, or the
one ``target(platform)`` sets while a program is built for another chip (``attnlab lower``).

**The fallback log.** A fused kernel that does not cover a call hands it on, and ``say``
logs one line naming the argument and where the call went, once per distinct line, on the
``attnlab.attention`` logger (``log_fallbacks`` prints it; ``attnlab train --verbose``).

**The plan.** ``recording()`` collects, while a program is traced, one ``Step`` per
attention call: the path it reached and the fallbacks on the way. ``where`` (set by the
caller, e.g. the layer a model's code stands for) names the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator

import jax

# A lowering platform name -> the backend the attention paths choose by.
PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("target", default=None)
_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "recorder", default=None
)

LOGGER = logging.getLogger("attnlab.attention")
_SAID: set[str] = set()


def backend() -> str:
    """The backend programs are built for: ``target``'s, else JAX's default."""
    target = _TARGET.get()
    return jax.default_backend() if target is None else PLATFORMS[target]


def lowering_only() -> bool:
    """Whether programs are built for a platform other than the host's (they can be lowered
    here, not run): library kernels that look at the local device cannot be built then."""
    target = _TARGET.get()
    return target is not None and PLATFORMS[target] != jax.default_backend()


def nvidia_target() -> bool:
    """Whether programs are built for CUDA on another host (``target("cuda")``)."""
    return _TARGET.get() == "cuda" and lowering_only()


@contextlib.contextmanager
def target(platform: str) -> Iterator[str]:
    """Builds models and attention calls for ``platform`` (``"cuda"``, ``"rocm"``,
    ``"tpu"``, ``"cpu"`` or a backend name) inside the block; yields the backend name."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} is unknown; use one of {sorted(PLATFORMS)}")
    token = _TARGET.set(platform)
    try:
        yield PLATFORMS[platform]
    finally:
        _TARGET.reset(token)


def log_fallbacks(stream=None) -> None:
    """Prints each fallback's line (once per process) on ``stream`` (default stderr): what
    ``attnlab train --verbose`` turns on."""
    if not any(getattr(h, "_attnlab", False) for h in LOGGER.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter("attention: %(message)s"))
        handler._attnlab = True
        LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)


def say(reason: str) -> None:
    """Logs one fallback line (once per distinct line), and notes it in the plan."""
    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.pending.append(reason)
    if reason not in _SAID:
        _SAID.add(reason)
        LOGGER.info(reason)


@dataclasses.dataclass(frozen=True)
class Step:
    """One attention call of a traced program: ``where`` it is (the caller's name for it),
    the ``path`` it reached (an implementation: ``"pallas_gpu"``, ``"chunked"``, ``"xla"``...),
    ``kernel`` whether that path is a fused kernel, and the ``fallbacks`` on the way."""

    where: str
    path: str
    kernel: bool
    fallbacks: tuple[str, ...] = ()

    def __str__(self) -> str:
        said = "".join(f"; {f}" for f in self.fallbacks)
        return f"{self.where}: {self.path}{said}"


KERNEL_PATHS = ("pallas_gpu", "pallas_tpu", "splash", "tokamax", "decode", "cudnn")


@dataclasses.dataclass
class Recorder:
    """What ``recording`` collects: ``steps`` in trace order; ``where()`` names a call."""

    where: Callable[[], str]
    steps: list[Step] = dataclasses.field(default_factory=list)
    pending: list[str] = dataclasses.field(default_factory=list)

    def reached(self, path: str) -> None:
        step = Step(self.where(), path, path in KERNEL_PATHS, tuple(self.pending))
        self.pending.clear()
        if step not in self.steps:  # a program traced twice (jit then lower) says it once
            self.steps.append(step)


@contextlib.contextmanager
def recording(where: Callable[[], str] = lambda: "attention") -> Iterator[Recorder]:
    """Collects the path of every attention call traced inside the block."""
    recorder = Recorder(where)
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def reached(path: str) -> None:
    """Notes, while a plan is recorded, that the call being traced runs ``path``."""
    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.reached(path)
