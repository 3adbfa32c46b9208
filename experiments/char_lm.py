"""Character-level decoder-only LM on the embedded corpus (the standard library's source).

The README's main command: runs on any machine with Python, no data to fetch.
``--config experiments/char_lm.py:tiny`` is its tiny CPU twin. Its corpus is one document,
so packing never mixes documents; ``:tiny_docs`` is the same twin on the embedded corpus cut
into short documents (``data.path="embedded:documents"``), so each packed row holds several.
"""

from attnlab.experiment import base_config, tiny_run

VARIANTS = ("tiny", "tiny_docs")


def get_config(variant=None):
    c = base_config()
    c.name = "char_lm"
    c.model.update(
        arch="decoder",
        vocab_size=256,
        d_model=128,
        n_layers=4,
        n_heads=4,
        max_len=128,
        position="rope",
        norm="rmsnorm",
        ffn="swiglu",
        d_ff=384,
        norm_bias=False,
    )
    c.data.update(kind="text", path="", tokenizer="char", seq_len=128, max_chars=2_000_000)
    c.optim.update(learning_rate=2e-3, warmup_steps=50, min_lr_ratio=0.1, weight_decay=0.1)
    c.train.update(steps=600, batch_size=16, seed=0, log_every_steps=20)
    c.eval.update(
        every_steps=100, batches=8, batch_size=32, sample_tokens=160, sample_prompt="def "
    )
    c.checkpoint.update(every_steps=200, max_to_keep=2)
    if variant in ("tiny", "tiny_docs"):
        tiny(c)
    if variant == "tiny_docs":
        c.data.path = "embedded:documents"
    return c


def tiny(c):
    c.model.update(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=32)
    c.data.update(seq_len=32, max_chars=50_000)
    tiny_run(c, sample_tokens=8)
