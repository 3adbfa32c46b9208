"""A mixture of experts against the dense model of equal active parameters, on the char LM.

The MoE model replaces every FFN by 8 SwiGLU experts of width ``F`` with top-2 routing
(``ffn_variant="moe"``); the dense baseline (variant ``dense``) has one SwiGLU FFN of width
``2F``, so each token passes through the same number of FFN weights (the router's
``D x 8`` per layer aside). Both train on the embedded corpus with the same data, steps
and optimiser; compare their losses at equal steps::

    attnlab train --config experiments/moe_lm.py --workdir runs/moe_lm/moe
    attnlab train --config experiments/moe_lm.py:dense --workdir runs/moe_lm/dense

``:tiny`` and ``:dense_tiny`` are the CPU twins. The MoE run logs its load-balancing and
z-losses, each expert's share of the assignments and the dropped assignments (0) at every
log line (``metrics.jsonl``); ``docs/moe.md`` reports the measured losses.
"""

from attnlab.experiment import base_config
from attnlab.experiment.harness import tiny_twin
from attnlab.experiment.presets import CHAR_LM_TRAINING, DECODER

VARIANTS = ("tiny", "dense", "dense_tiny")
EXPERTS, TOP_K, D_EXPERT = 8, 2, 96


def get_config(variant=None):
    c = base_config()
    c.name = "moe_lm"
    # d_ff is the dense model's width; each expert has D_EXPERT.
    c.model.update(DECODER, vocab_size=256, d_model=96, n_layers=3, n_heads=4, max_len=128,
                   d_ff=TOP_K * D_EXPERT)  # fmt: skip
    c.update(CHAR_LM_TRAINING)
    if variant in ("tiny", "dense_tiny"):
        tiny_twin(c, n_layers=2, d_ff=2 * 16, max_len=32, seq_len=32, max_chars=50_000,
                  sample_tokens=8)  # fmt: skip
    if variant not in ("dense", "dense_tiny"):
        c.model.ffn_variant = "moe"
        d_expert = c.model.d_ff // TOP_K
        c.model.ffn_settings.update(n_experts=EXPERTS, top_k=TOP_K, d_expert=d_expert)
    return c
