"""``GenerateOptions``: what ``generate`` may be asked, in four groups.

``generate(model, ids, n, options=GenerateOptions(...))`` takes the groups whole; the field
names also work as keywords (``generate(model, ids, n, temperature=0.8, num_beams=4)``),
each routed to its group, as Hugging Face's ``generate(**kwargs)`` updates its
``GenerationConfig``. A name no group has is a ``DecodeError`` listing the names there are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnlab.decode.sampling import SamplingConfig
from attnlab.errors import DecodeError


@dataclasses.dataclass(frozen=True)
class Beams:
    """``num_beams > 1``: beam search, scored by summed log-probs / length**length_penalty."""

    num_beams: int = 1
    length_penalty: float = 1.0

    def check(self, greedy: bool, return_logits: bool, recompute: bool, vocab_size: int):
        n = self.num_beams
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise DecodeError(f"num_beams={n!r} must be an int >= 1")
        if n == 1:
            return
        if not greedy:
            raise DecodeError("num_beams > 1 is deterministic beam search: leave temperature 0")
        if return_logits:
            raise DecodeError("return_logits is only available with num_beams=1")
        if recompute:
            raise DecodeError("num_beams > 1 needs the KV cache: recompute supports num_beams=1")
        if 2 * n > vocab_size:
            raise DecodeError(f"num_beams={n} needs vocab_size >= {2 * n}")


@dataclasses.dataclass(frozen=True)
class Stopping:
    """When rows stop: at ``eos_id`` (``"config"``: the handle's; None: never early), at
    ``max_new_tokens``, or at the cache's capacity (``on_overflow="stop"``; ``"raise"``
    refuses before any computation). ``pad_id`` fills stopped rows (None: the config's)."""

    eos_id: int | None | str = "config"
    pad_id: int | None = None
    on_overflow: str = "raise"

    def check(self):
        if self.on_overflow not in ("raise", "stop"):
            raise DecodeError(f"on_overflow={self.on_overflow!r} must be 'raise' or 'stop'")


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """How the model runs while generating: the cache capacity ``max_len`` (default
    ``ModelConfig.max_len``), a ``ring`` buffer (True, False, None: where it fits), the
    prompt fed ``prefill_chunk`` tokens at a time, the ``dtype`` of weights and cache, a
    ``mesh`` to decode on, or ``recompute`` (no cache: the whole sequence per token)."""

    max_len: int | None = None
    ring: bool | None = None
    prefill_chunk: int | None = None
    dtype: str | None = None
    mesh: Any = None
    recompute: bool = False

    def check(self, recompute: bool):
        if self.ring is not None and not isinstance(self.ring, bool):
            raise DecodeError(
                f"ring={self.ring!r} must be True, False or None (ring where it fits)"
            )
        if self.ring and recompute:
            raise DecodeError(
                "ring=True asks for a ring-buffer KV cache, but recompute=True (implied by "
                "ModelConfig.causal=False) uses no cache: pass ring=None, or recompute=False"
            )


_SAMPLING = ("temperature", "top_k", "top_p", "min_p")


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """Everything ``generate`` may be asked besides the inputs: sampling (``seed`` draws
    the key), beams, stopping, the cache, and whether to return each step's logits."""

    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    seed: int = 0
    beams: Beams = Beams()
    stop: Stopping = Stopping()
    cache: CacheOptions = CacheOptions()
    return_logits: bool = False

    def updated(self, **flat) -> GenerateOptions:
        """These options with flat field names (``temperature=0.8``, ``ring=True``) set in
        their groups."""
        groups = {"sampling": _SAMPLING}
        groups |= {g: tuple(f.name for f in dataclasses.fields(type(getattr(self, g))))
                   for g in ("beams", "stop", "cache")}  # fmt: skip
        top = {"seed", "return_logits"}
        known = sorted(top.union(*groups.values()))
        if unknown := sorted(set(flat) - set(known)):
            raise DecodeError(f"generate() has no option {unknown}; the options are {known}")
        out = dataclasses.replace(self, **{k: v for k, v in flat.items() if k in top})
        for group, names in groups.items():
            mine = {k: v for k, v in flat.items() if k in names}
            if mine:
                out = dataclasses.replace(
                    out, **{group: dataclasses.replace(getattr(out, group), **mine)}
                )
        return out
