"""Character-level decoder-only LM on the embedded corpus (the standard library's source).

The README's main command: runs on any machine with Python, no data to fetch.
``--config experiments/char_lm.py:tiny`` is its tiny CPU twin. Its corpus is one document,
so packing never mixes documents; ``:tiny_docs`` is the same twin on the embedded corpus cut
into short documents (``data.path="embedded:documents"``), so each packed row holds several.
"""

from attnlab.experiment import base_config
from attnlab.experiment.harness import tiny_twin
from attnlab.experiment.presets import CHAR_LM_TRAINING, DECODER

VARIANTS = ("tiny", "tiny_docs")


def get_config(variant=None):
    c = base_config()
    c.name = "char_lm"
    c.model.update(DECODER, vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_len=128,
                   d_ff=384)  # fmt: skip
    c.update(CHAR_LM_TRAINING)
    if variant in ("tiny", "tiny_docs"):
        tiny_twin(c, d_ff=64, max_len=32, seq_len=32, max_chars=50_000, sample_tokens=8)
    if variant == "tiny_docs":
        c.data.path = "embedded:documents"
    return c
