"""Models built from a ``ModelConfig``: ``build_model`` (parameters initialised in one
compiled program per config), ``init_params`` (the same as a pure function of the seed) and
``count_params`` (from shapes alone). The architectures' classes come from
``MODEL_CLASSES``, which ``attnlab.nn.models`` fills.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.nn import parametrization
from attnlab.nn.registry import MODEL_CLASSES


def build_model(cfg: ModelConfig, *, seed: int = 0, rngs: nnx.Rngs | None = None):
    """The architecture ``cfg.arch`` with freshly initialised parameters.

    With a ``seed``, every parameter is initialised in one compiled program (cached per
    config, the seed traced); ``rngs`` builds eagerly from the given streams.
    """
    cls = MODEL_CLASSES[cfg.arch]
    if rngs is not None:
        model = cls(cfg, rngs=rngs)
        if not parametrization.is_standard(cfg):
            params = nnx.state(model, nnx.Param)
            nnx.update(model, parametrization.scale_tree(params, _init_multipliers(cfg)))
        return model
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, _init_jit(cfg, np.uint32(seed)))


def init_params(cfg: ModelConfig, seed):
    """The parameter state of ``build_model(cfg, seed=seed)``, as a pure function of the
    (traceable) seed: jit it, with output shardings on a mesh. Under muP each parameter
    is scaled by its initialisation multiplier (``attnlab.nn.parametrization``)."""
    state = nnx.state(MODEL_CLASSES[cfg.arch](cfg, rngs=nnx.Rngs(jax.random.key(seed))))
    if parametrization.is_standard(cfg):
        return state
    return parametrization.scale_tree(state, _init_multipliers(cfg))


def _init_multipliers(cfg: ModelConfig):
    """The initialisation multipliers as a tree like ``nnx.state(model)`` (Params only,
    which is all the state the architectures hold)."""
    return parametrization.init_multipliers(cfg)


_init_jit = jax.jit(init_params, static_argnums=0)


def count_params(cfg: ModelConfig, *, active: bool = False) -> int:
    """Number of parameters, from shapes alone (nothing is allocated).

    ``active``: the parameters one token uses, a mixture of experts' routed experts (the
    parameters whose names start with the expert axis, ``w_in_EDF``...) counted for
    ``top_k`` of ``n_experts``; the router and shared experts count whole."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"count_params takes a ModelConfig, got {type(cfg).__name__}; convert a Hugging "
            "Face config with attnlab.pretrained.model_config_from_hf"
        )
    sizes = _param_sizes(cfg)
    if not active or not hasattr(cfg.ffn_settings, "top_k"):
        return sum(size for _, size in sizes)
    s = cfg.ffn_settings
    routed = lambda name: re.search(r"_E[A-Z]+$", name) is not None
    return sum(size // s.n_experts * s.top_k if routed(name) else size for name, size in sizes)


@functools.lru_cache(maxsize=64)
def _param_sizes(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """``(name, size)`` of each parameter of ``cfg``'s model, traced once per config (the
    total and the active count of one config share the trace)."""
    abstract = nnx.eval_shape(lambda: MODEL_CLASSES[cfg.arch](cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = (k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str))
        out.append((next(keys, ""), int(x.size)))
    return tuple(out)
