"""attnlab: transformer attention research in JAX and Flax NNX.

``attnlab.ops`` holds pure functions, ``attnlab.nn`` the NNX modules and architectures,
``attnlab.config`` the validated ``ModelConfig``, ``attnlab.decode`` generation
(``attnlab.generate``); ``attnlab.load_run(DIR)`` reopens a trained run as a ``Run``.
"""

from attnlab import ops
from attnlab.architectures import Architecture, architecture
from attnlab.compilation import compilation_cache
from attnlab.config import ModelConfig
from attnlab.decode import GenerateOptions, GenerationResult, generate
from attnlab.ffns import FFN, FFNSettings, register_ffn, registered_ffns
from attnlab.kv_cache import KVCache, init_cache, kv_cache_bytes
from attnlab.mixers import (
    CacheEntry,
    Mixer,
    MixerCall,
    MixerSettings,
    register_mixer,
    registered_mixers,
)
from attnlab.nn import build_model, count_params
from attnlab.optimizers import register_optimizer, register_schedule
from attnlab.surgery import (
    freeze,
    layer_kind_names,
    layer_mask,
    replace_mixer,
    select_layers,
)
from attnlab.variants import attention_variants, register_attention

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
    # The Hugging Face loading stack (safetensors, tables of every family) loads on first use.
    if name == "load_pretrained":
        from attnlab.pretrained import load_pretrained

        return load_pretrained
    if name in ("load_run", "Run"):  # the training stack loads on first use too
        from attnlab.runs import loading

        return getattr(loading, name)
    if name in ("Metric", "StepView", "register_metric", "registered_metrics"):
        from attnlab.train import metrics  # the step metrics load with the training stack

        return getattr(metrics, name)
    if name in ("speculative_generate", "SpeculativeResult"):
        from attnlab.decode import speculative

        return getattr(speculative, name)
    if name == "pretrained":
        import attnlab.pretrained

        return attnlab.pretrained
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
