"""Encoder-only (BERT-style, post-norm) masked language model on the embedded corpus."""

from attnlab.experiment import base_config
from attnlab.experiment.harness import tiny_twin
from attnlab.experiment.presets import EMBEDDED_CHARS


def get_config(variant=None):
    c = base_config()
    c.name = "mlm_encoder"
    c.model.update(arch="encoder", vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                   max_len=128, position="learned", norm="layernorm", norm_placement="post",
                   embedding_norm=True, ffn="gelu", attn_bias=True, out_bias=True,
                   ffn_bias=True, logits_bias=True)  # fmt: skip
    c.data.update(EMBEDDED_CHARS, kind="mlm_text", seq_len=128, mask_rate=0.15,
                  max_chars=1_000_000)  # fmt: skip
    c.optim.update(learning_rate=1e-3, warmup_steps=100)
    c.train.update(steps=1000, batch_size=32, log_every_steps=25)
    c.eval.update(every_steps=250, batches=8, batch_size=32, sample_tokens=0)
    c.checkpoint.update(every_steps=500)
    if variant == "tiny":
        tiny_twin(c, max_len=32, seq_len=32, max_chars=20_000)
    return c
