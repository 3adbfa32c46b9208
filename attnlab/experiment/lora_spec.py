"""The ``lora`` config group checked (``LoraSpec``, ``spec_from``, ``check``): what a run's
config asks of its low-rank adapters, read before any model is built. The adapters
themselves are ``attnlab.train.lora``'s."""

from __future__ import annotations

import dataclasses

from attnlab.errors import ConfigError

ALIASES = {
    "q": "*attn.q_*",
    "k": "*attn.k_*",
    "v": "*attn.v_*",
    "o": "*attn.o_*",
    "ffn": "*ffn.*",
    "mixer": "*attn.*",
}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """A checked ``lora`` config group."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    def patterns(self) -> tuple[str, ...]:
        return tuple(ALIASES.get(t, t) for t in self.targets)


def _fail(field, value, fix):
    raise ConfigError(f"lora.{field}={value!r} is invalid: {fix}; set --config.lora.{field}=...")


def spec_from(group) -> LoraSpec | None:
    """The ``lora`` group as a ``LoraSpec``, or None when ``rank`` is 0 (no adapters)."""
    if not group:
        return None
    rank = group.get("rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        _fail("rank", rank, "an int >= 0 (0: no adapters; LoLCATs uses 8)")
    if rank == 0:
        return None
    alpha = group.get("alpha", 16.0)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        _fail("alpha", alpha, "a positive number (the update is alpha / rank times A B)")
    dropout = group.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        _fail("dropout", dropout, "a probability in [0, 1)")
    targets = group.get("targets", ("q", "k", "v", "o"))
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        _fail("targets", targets, f"parameter path globs or names among {sorted(ALIASES)}")
    return LoraSpec(rank, float(alpha), targets, float(dropout))


def check(cfg) -> None:
    """The ``lora`` group of a run's config against the rest: one ``ConfigError`` line."""
    spec = spec_from(cfg.get("lora"))
    if spec is None:
        return
    if (cfg.get("freeze") or {}).get("mode", "none") != "none":
        raise ConfigError(
            f"freeze.mode={cfg.freeze.mode!r} is invalid with lora.rank={spec.rank}: LoRA "
            "freezes every parameter and trains the adapters alone; set "
            "--config.freeze.mode=none (or --config.lora.rank=0)"
        )
    name = cfg.optim.get("name", "adamw")
    if name == "muon":
        raise ConfigError(
            f"optim.name={name!r} is invalid with lora.rank={spec.rank}: the adapters' "
            "factors are no weights Muon reads; use --config.optim.name=adamw (or lion)"
        )
