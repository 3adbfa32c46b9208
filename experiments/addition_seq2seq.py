"""Encoder-decoder (the 2017 Transformer shape) learning multi-digit addition.

Sources are ``a+b`` as digits, targets the digits of the sum; evaluation reports the
exact-match rate on held-out problems (a fixed evaluation stream no training step draws).
"""

from attnlab.experiment import base_config


def get_config(variant=None):
    c = base_config()
    c.name = "addition_seq2seq"
    c.model.update(
        arch="encoder_decoder",
        vocab_size=16,
        d_model=128,
        n_layers=2,
        n_heads=4,
        max_len=16,
        position="sinusoidal",
        norm="layernorm",
        norm_placement="pre",
        ffn="relu",
        d_ff=256,
        tie_embeddings=True,
        pad_id=0,
    )
    c.data.update(kind="addition", seq_len=16, min_len=1, max_len=5)
    c.optim.update(learning_rate=1e-3, warmup_steps=100, weight_decay=0.01)
    c.train.update(steps=2500, batch_size=64, log_every_steps=50)
    c.eval.update(every_steps=500, batches=8, batch_size=128, sample_tokens=0)
    c.checkpoint.update(every_steps=500)
    if variant == "tiny":
        c.model.update(d_model=32, n_layers=1, n_heads=2, d_ff=64)
        c.train.update(steps=3, batch_size=8, log_every_steps=1)
        c.eval.update(every_steps=3, batches=1, batch_size=8)
        c.checkpoint.update(every_steps=3)
    return c
