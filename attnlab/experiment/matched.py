"""Rows of a comparison matched in size: each row's ``d_model`` and FFN width chosen so that
its parameter count (``attnlab.count_params``) is closest to that of ``mha`` at the given
model's size (``experiments/attention_zoo.py`` sizes its rows with it)."""

from __future__ import annotations

import functools
import json
import math

from attnlab.experiment import ExperimentError


@functools.lru_cache(maxsize=1024)
def param_count(text: str):
    """``count_params`` of a model config (as JSON), or the one-line reason it is invalid."""
    from attnlab.config import ModelConfig
    from attnlab.errors import ConfigError
    from attnlab.nn.models import count_params

    try:
        return count_params(ModelConfig.from_dict(json.loads(text)))
    except ConfigError as e:
        return str(e)


def as_json(model, **changes) -> str:
    """``model`` (a config or a dict) with ``changes``, as sorted JSON (``param_count``'s key)."""
    fields = model.to_dict() if hasattr(model, "to_dict") else dict(model)
    fields.update(changes)
    return json.dumps(fields, sort_keys=True)


def matched_sizes(model, table: dict[str, dict], names=None) -> dict:
    """``{row: {"d_model", "d_ff", "params", "ratio"}}``: for each row (``table``'s names, or a
    registered mixer's name; ``table`` maps a row to its model fields), the ``d_model`` (a
    multiple of ``2 * n_heads``, so RoPE's head dim stays even) whose parameter count is closest
    to ``mha``'s at ``model``'s size, then the ``d_ff`` that brings it closest; ``{"error":
    ...}`` when none builds."""
    names = list(table) if names is None else list(names)
    target = param_count(as_json(model, mixer="mha"))
    if isinstance(target, str):
        raise ExperimentError(f"model: {target}")
    step, d = 2 * model["n_heads"], model["d_model"]
    candidates = list(range(step, 4 * d + 1, step))
    out = {}
    for name in names:
        fields = table.get(name, {"mixer": name})
        count = lambda dm, f=fields, **more: param_count(as_json(model, **f, d_model=dm, **more))
        lo, hi = 0, len(candidates) - 1  # the first candidate whose count reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            n = count(candidates[mid])
            if isinstance(n, int) and n >= target:
                hi = mid
            else:
                lo = mid + 1
        tried = [candidates[i] for i in (lo - 1, lo) if i >= 0]
        sized = [
            (abs(math.log(n / target)), dm, n) for dm in tried if isinstance(n := count(dm), int)
        ]
        if not sized:
            out[name] = {"error": count(d)}
            continue
        dm = min(sized)[1]
        d_ff = (model["d_ff"] or 4 * d) * dm // d  # the FFN's width scales with d_model
        per_column = count(dm, d_ff=d_ff + 1) - count(dm, d_ff=d_ff)
        d_ff = max(1, d_ff + round((target - count(dm, d_ff=d_ff)) / per_column))
        n = count(dm, d_ff=d_ff)
        out[name] = {"d_model": dm, "d_ff": d_ff, "params": n, "ratio": round(n / target, 4)}
    return out
