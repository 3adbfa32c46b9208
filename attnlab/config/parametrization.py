"""How initialisation, learning rates and a few forward multipliers change with the model's
width and depth: ``ModelConfig.parametrization``.

* ``"standard"``: every parameter initialised at its module's scale (``init_std``), one
  learning rate for all, attention logits scaled by ``head_dim ** -0.5``.
* ``"mup"`` (maximal update parametrisation, Yang et al., Tensor Programs V, 2022), relative
  to a base width ``ModelConfig.base_width`` (None: ``d_model``, so nothing changes): with
  ``m`` a parameter's fan-in over its fan-in at the base width, hidden matrices are
  initialised ``1/sqrt(m)`` times smaller and read-out matrices (from the width to a fixed
  size: a router, a gate) ``1/m`` times smaller; the optimiser's rule (below) sets each
  parameter's learning-rate multiplier; the attention logits are scaled by ``1/head_dim``
  (``head_dim ** -0.5`` times ``sqrt(base head_dim / head_dim)``) and the output logits are
  multiplied by ``base_width / d_model``. At the base width every multiplier is exactly 1,
  so the model, its initial parameters and its updates equal the standard ones bitwise.
* ``"completep"`` (Dey et al., 2025; depth-muP with alpha = 1): muP in width, and every
  residual branch multiplied by ``base_depth / n_layers`` (``ModelConfig.base_depth``; None:
  ``n_layers``); learning rates do not change with depth.

Roles. Each parameter's role is read from its shape alone, by comparing the model's
parameter shapes at the base width with those at twice the base width (as Microsoft's
``mup`` does with its base shapes): an axis that grows is a width axis. The input axes of a
weight are its first when its shape suffix starts with ``D`` (``q_DNH``, ``w_in_DF``), else
all but its last (``o_NHD``, ``w_out_FD``), the reading Muon uses (``attnlab.contracts.optimizer``).
A weight with width axes on both sides is ``hidden``; on its input side only, ``readout``;
on its output side only (an embedding table), ``input``; a weight of one axis (a norm
scale, a bias) or of no width axis is ``vector``. A module overrides the reading for its own
parameter names with a class attribute ``parameter_roles = {"name_SUFFIX": role}`` (the LM
head is ``head``: a read-out whose multiplier is the forward ``base_width / d_model``,
Microsoft's ``MuReadout``). Widths derived from ``d_model`` (``head_dim``, ``d_ff``, a
mixer's inner widths) scale with it; one given explicitly stays, and so its axes do not.

Learning-rate rules (``RULES``; an optimiser names its rule when it is registered):

* ``adam`` (AdamW, Lion, Adafactor without parameter scaling, schedule-free AdamW, ...:
  updates of order ``lr`` in every entry): hidden and read-out ``1/m_in``; others 1.
* ``muon``: the matrices Muon orthogonalises take ``sqrt(fan_out / fan_in)`` over the
  ``sqrt(max(1, fan_out / fan_in))`` optax applies (the spectral condition), relative to the
  base width, and the head divided by its forward multiplier; the rest follow ``adam``.
* ``sgd``: hidden ``m_out / m_in``, read-out ``1/m_in``, input, vector and head ``m_out``
  (or ``m`` of their width axis).

Weight decay is decoupled and multiplied with the learning rate (as in optax's AdamW), so it
follows the multipliers; Adam's epsilon is not rescaled. The standard initialisation's
``1/sqrt(2 n_layers)`` on the residual branches' output projections stays under CompleteP.
"""

from __future__ import annotations

import dataclasses

import jax

from attnlab.errors import ConfigError

PARAMETRIZATIONS = ("standard", "mup", "completep")
ROLES = ("hidden", "readout", "input", "vector", "head")
# Names (their stem) of parameters that act elementwise: a norm's scale, a bias.
ELEMENTWISE = ("bias", "scale", "norm")


def is_standard(cfg) -> bool:
    return cfg.parametrization == "standard"


def width_base(cfg) -> int:
    """The base width (``d_model`` when unset or standard)."""
    return cfg.d_model if is_standard(cfg) or cfg.base_width is None else cfg.base_width


def depth_base(cfg) -> int:
    return cfg.n_layers if is_standard(cfg) or cfg.base_depth is None else cfg.base_depth


def attention_scale(cfg, head_dim_follows_width: bool) -> float:
    """The derived ``attn_scale``: ``head_dim ** -0.5``, times ``sqrt(base / head_dim)``
    under muP when ``head_dim`` follows ``d_model`` (1/d attention), exactly the standard
    value at the base width."""
    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    scale = head_dim**-0.5
    base = cfg.base_width
    if is_standard(cfg) or not isinstance(base, int) or base <= 0 or not head_dim_follows_width:
        return scale  # (a bad base width fails in ``check``, which runs after derivation)
    return scale * ((cfg.base_width // cfg.n_heads) / head_dim) ** 0.5


def readout_multiplier(cfg) -> float:
    """The forward multiplier of the output logits: ``base_width / d_model`` under muP."""
    return width_base(cfg) / cfg.d_model


def residual_multiplier(cfg) -> float:
    """Each residual branch's multiplier: ``residual_scale``, times ``base_depth /
    n_layers`` under CompleteP."""
    depth = depth_base(cfg) / cfg.n_layers if cfg.parametrization == "completep" else 1.0
    return cfg.residual_scale * depth


def check(cfg) -> None:
    """The parametrisation fields' checks, one ``ConfigError`` line each."""
    if cfg.parametrization not in PARAMETRIZATIONS:
        raise ConfigError(
            f"ModelConfig.parametrization={cfg.parametrization!r} is invalid: use one of "
            f"{list(PARAMETRIZATIONS)}"
        )
    for field in ("base_width", "base_depth"):
        value = getattr(cfg, field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value <= 0):  # fmt: skip
            raise ConfigError(
                f"ModelConfig.{field}={value!r} is invalid: a positive integer, or None for "
                f"the model's own ({'d_model' if field == 'base_width' else 'n_layers'})"
            )
    follows = "head_dim" in cfg._derived
    if cfg.base_width is not None and follows and cfg.base_width % cfg.n_heads:
        raise ConfigError(
            f"ModelConfig.base_width={cfg.base_width!r} is invalid: it does not divide into "
            f"n_heads={cfg.n_heads} heads; use a multiple of {cfg.n_heads}"
        )
    scale = cfg.residual_scale
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not scale > 0:
        raise ConfigError(
            f"ModelConfig.residual_scale={scale!r} is invalid: a positive number (1.0: none)"
        )


def standard_equivalent(cfg):
    """The standard-parametrisation config whose model computes exactly what ``cfg``'s does
    with the same parameters: the attention scale, the logits multiplier and the residual
    multiplier written out (``attn_scale``, ``logits_scale``, ``residual_scale``). Loading
    and exporting Hugging Face checkpoints speak this form."""
    if is_standard(cfg):
        return cfg
    return cfg.replace(
        parametrization="standard",
        base_width=None,
        base_depth=None,
        attn_scale=cfg.attn_scale,
        logits_scale=cfg.logits_scale * readout_multiplier(cfg),
        residual_scale=residual_multiplier(cfg),
    )


# Roles and multipliers ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Scale:
    """One parameter's reading: its role, fan-in and fan-out at this width and at the base
    width (products of its input and output axes), whether Muon orthogonalises it, and its
    initialisation multiplier."""

    role: str
    fan_in: int
    fan_out: int
    base_fan_in: int
    base_fan_out: int
    muon: bool

    @property
    def m_in(self) -> float:
        return self.fan_in / self.base_fan_in

    @property
    def m_out(self) -> float:
        return self.fan_out / self.base_fan_out

    @property
    def init(self) -> float:
        if self.role == "hidden":
            return (self.base_fan_in / self.fan_in) ** 0.5
        if self.role == "readout":
            return self.base_fan_in / self.fan_in
        return 1.0


def _adam(s: Scale) -> float:
    return s.base_fan_in / s.fan_in if s.role in ("hidden", "readout") else 1.0


def _muon(s: Scale) -> float:
    if not s.muon:
        return _adam(s)

    def spectral(fan_in, fan_out):
        return (fan_out / fan_in) ** 0.5 / max(1.0, fan_out / fan_in) ** 0.5

    ratio = spectral(s.fan_in, s.fan_out) / spectral(s.base_fan_in, s.base_fan_out)
    return ratio * s.m_in if s.role == "head" else ratio  # the head's forward is 1/m_in


def _sgd(s: Scale) -> float:
    if s.role == "hidden":
        return s.m_out / s.m_in
    if s.role == "readout":
        return 1 / s.m_in
    if s.role == "head":
        return s.m_in
    return max(s.m_out, s.m_in)  # input and vectors: their width axis


# The learning-rate rules an optimiser may name (``register_optimizer(..., rule=)``).
RULES = {"adam": _adam, "muon": _muon, "sgd": _sgd}


def scale_tree(tree, multipliers):
    """``tree`` times ``multipliers`` leaf by leaf; leaves whose multiplier is 1.0 are left
    as they are (so the base width is the standard model bitwise)."""
    return jax.tree.map(lambda x, m: x if m == 1.0 else (x * m).astype(x.dtype), tree, multipliers)


def scale_updates(multipliers):
    """An optax transformation that multiplies each parameter's update by its multiplier."""
    import optax

    return optax.stateless(lambda updates, params=None: scale_tree(updates, multipliers))
