"""The three architectures as data: what each can do, asked by capability, never by name.

``architecture(cfg)`` (a ``ModelConfig`` or a name) gives an ``Architecture``; code asks
``.generates`` (a causal decoder that produces tokens and keeps a KV cache), ``.seq2seq``
(an encoder feeding that decoder through cross-attention) or ``.bidirectional`` (an encoder
whose tokens see both ways), and ``.stack_layers(cfg)`` (the layers a KV cache serves).
``attnlab.nn.models`` maps the same names to the NNX classes that implement them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One architecture's capabilities (see the module docstring)."""

    name: str
    generates: bool
    bidirectional: bool
    objective: str  # the training objective it is built for: "next_token" or "masked"

    @property
    def seq2seq(self) -> bool:
        """An encoder and a generating decoder (cross-attention between them)."""
        return self.generates and self.bidirectional

    def stack_layers(self, cfg) -> int:
        """The layers of the stack a KV cache serves (the decoder's)."""
        return cfg.n_decoder_layers if self.seq2seq else cfg.n_layers


ARCHITECTURES = {
    a.name: a
    for a in (
        Architecture("decoder", generates=True, bidirectional=False, objective="next_token"),
        Architecture("encoder", generates=False, bidirectional=True, objective="masked"),
        Architecture("encoder_decoder", generates=True, bidirectional=True, objective="next_token"),
    )
}


def architecture(cfg_or_name) -> Architecture:
    """The ``Architecture`` of a ``ModelConfig`` (its ``arch``) or of a name."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.arch
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"arch={name!r} is not one of {tuple(ARCHITECTURES)}") from None
