"""attnlab: transformer attention research in JAX and Flax NNX.

``attnlab.ops`` holds pure functions, ``attnlab.nn`` the NNX modules and architectures,
``attnlab.inspect`` captures and patches any named intermediate of a model,
``attnlab.config`` the validated ``ModelConfig``, ``attnlab.decode`` generation
(``attnlab.generate``); ``attnlab.load_run(DIR)`` reopens a trained run as a ``Run``.
"""

import signal as _signal
import sys as _sys

# The ``attnlab`` command (its console script imports this package first): SIGINT is held
# from here until ``attnlab.cli.main`` takes the hold over, so Ctrl-C while the package and
# the command load is the command's one line and status 130, not a traceback from inside an
# import. A program that imports attnlab keeps its own SIGINT handling.
_EARLY_SIGINT: list | None = None
_main_file = getattr(_sys.modules.get("__main__"), "__file__", None) or ""
if _main_file.replace("\\", "/").rsplit("/", 1)[-1] in ("attnlab", "attnlab-script.py"):
    try:
        if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
            _EARLY_SIGINT = []
            _signal.signal(_signal.SIGINT, lambda signum, frame: _EARLY_SIGINT.append(signum))
    except ValueError:  # not the main thread: nothing to hold
        _EARLY_SIGINT = None
del _main_file

import importlib  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from attnlab import _moved  # noqa: E402 - first: the previous release's module paths, deprecated

# The package's names and the modules that define them, imported on first use: ``import
# attnlab`` (and so the ``attnlab`` command's own start) stays light until a name is read.
_HOMES = {
    "ops": "attnlab.ops",
    "Architecture": "attnlab.config.architectures",
    "architecture": "attnlab.config.architectures",
    "compilation_cache": "attnlab.compilation",
    "ModelConfig": "attnlab.config",
    "GenerateOptions": "attnlab.decode",
    "GenerationResult": "attnlab.decode",
    "generate": "attnlab.decode",
    "FFN": "attnlab.contracts.ffn",
    "FFNSettings": "attnlab.contracts.ffn",
    "register_ffn": "attnlab.contracts.ffn",
    "registered_ffns": "attnlab.contracts.ffn",
    "KVCache": "attnlab.kv_cache",
    "init_cache": "attnlab.kv_cache",
    "kv_cache_bytes": "attnlab.kv_cache",
    "CacheEntry": "attnlab.contracts.mixer",
    "Mixer": "attnlab.contracts.mixer",
    "MixerCall": "attnlab.contracts.mixer",
    "MixerSettings": "attnlab.contracts.mixer",
    "register_mixer": "attnlab.contracts.mixer",
    "registered_mixers": "attnlab.contracts.mixer",
    "build_model": "attnlab.nn",
    "count_params": "attnlab.nn",
    "register_optimizer": "attnlab.contracts.optimizer",
    "register_schedule": "attnlab.contracts.optimizer",
    "freeze": "attnlab.nn.surgery",
    "layer_kind_names": "attnlab.nn.surgery",
    "layer_mask": "attnlab.nn.surgery",
    "replace_mixer": "attnlab.nn.surgery",
    "select_layers": "attnlab.nn.surgery",
    "attention_variants": "attnlab.contracts.score_function",
    "register_attention": "attnlab.contracts.score_function",
    # The Hugging Face loading stack (safetensors, tables of every family) and the
    # training stack.
    "load_pretrained": "attnlab.pretrained",
    "pretrained": "attnlab.pretrained",
    "load_run": "attnlab.runs.loading",
    # The step metrics load with the training stack; speculative decoding with decode.
    "Metric": "attnlab.metrics",
    "StepView": "attnlab.metrics",
    "register_metric": "attnlab.metrics",
    "registered_metrics": "attnlab.metrics",
    "speculative_generate": "attnlab.decode.speculative",
    "SpeculativeResult": "attnlab.decode.speculative",
    "Run": "attnlab.runs.loading",
}

if TYPE_CHECKING:  # what readers and type checkers see
    from attnlab import ops
    from attnlab.compilation import compilation_cache
    from attnlab.config import ModelConfig
    from attnlab.config.architectures import Architecture, architecture
    from attnlab.contracts.ffn import FFN, FFNSettings, register_ffn, registered_ffns
    from attnlab.contracts.mixer import (
        CacheEntry,
        Mixer,
        MixerCall,
        MixerSettings,
        register_mixer,
        registered_mixers,
    )
    from attnlab.contracts.optimizer import register_optimizer, register_schedule
    from attnlab.contracts.score_function import attention_variants, register_attention
    from attnlab.decode import GenerateOptions, GenerationResult, generate
    from attnlab.decode.speculative import SpeculativeResult, speculative_generate
    from attnlab.kv_cache import KVCache, init_cache, kv_cache_bytes
    from attnlab.metrics import Metric, StepView, register_metric, registered_metrics
    from attnlab.nn import build_model, count_params
    from attnlab.nn.surgery import (
        freeze,
        layer_kind_names,
        layer_mask,
        replace_mixer,
        select_layers,
    )
    from attnlab.pretrained import load_pretrained
    from attnlab.runs.loading import Run, load_run

__all__ = [
    "Architecture",
    "CacheEntry",
    "FFN",
    "FFNSettings",
    "GenerateOptions",
    "GenerationResult",
    "KVCache",
    "Metric",
    "Mixer",
    "MixerCall",
    "MixerSettings",
    "ModelConfig",
    "Run",
    "SpeculativeResult",
    "StepView",
    "architecture",
    "attention_variants",
    "build_model",
    "compilation_cache",
    "count_params",
    "freeze",
    "generate",
    "init_cache",
    "inspect",
    "kv_cache_bytes",
    "layer_kind_names",
    "layer_mask",
    "load_pretrained",
    "load_run",
    "ops",
    "register_attention",
    "register_ffn",
    "register_metric",
    "register_mixer",
    "register_optimizer",
    "register_schedule",
    "registered_ffns",
    "registered_metrics",
    "registered_mixers",
    "replace_mixer",
    "select_layers",
    "speculative_generate",
]
__version__ = "0.1.0"


def __getattr__(name):
    home = _HOMES.get(name)
    if home is None and not name.startswith("_"):  # a subpackage or module: attnlab.nn
        try:
            return importlib.import_module(f"attnlab.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"attnlab.{name}":
                raise
    if home is None:
        return _moved.moved_name(__name__, name)
    module = importlib.import_module(home)
    value = module if home == f"attnlab.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
