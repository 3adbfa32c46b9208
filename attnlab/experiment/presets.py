"""Named model and data settings that several experiment files share, each a dict to start a
config group from (``c.model.update(STUDY_DECODER, n_layers=4)``: the preset, then what the
experiment changes).

Models: ``DECODER`` is the house's decoder recipe (pre-norm RMSNorm without biases, SwiGLU,
RoPE) at no particular size; ``STUDY_DECODER`` is that recipe at the size of the CPU-scale
studies (2 layers of 4 heads, d_model 64, FFN 192, 256 byte ids); ``MUP_DECODER`` is the
muP-parametrised decoder whose width the transfer and scaling studies turn (relative to a
base width of 32, unrolled); ``GPT2_SMALL`` is GPT-2 small's shape. Data: ``EMBEDDED_CHARS``
(character ids of the embedded corpus, the standard library's source) and
``SHAKESPEARE_CHARS`` (character ids of tiny Shakespeare from the data cache, all of it).
Whole recipes, applied with ``c.update(...)``: ``CHAR_LM_TRAINING`` is how the char LM
(``experiments/char_lm.py``) and the models set beside it train: its data, optimiser, steps,
evaluation and checkpoints; ``STUDY_TRAINING`` is how the CPU-scale studies on the embedded
corpus train: a million characters of it and their optimiser (each study sets its rows'
length and its schedule).
"""

from __future__ import annotations

DECODER = {"arch": "decoder", "position": "rope", "norm": "rmsnorm", "ffn": "swiglu",
           "norm_bias": False}  # fmt: skip

STUDY_DECODER = {**DECODER, "vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4,
                 "d_ff": 192}  # fmt: skip

MUP_DECODER = {**DECODER, "vocab_size": 65, "d_model": 32, "n_layers": 2, "max_len": 32,
               "ffn": "gelu", "tie_embeddings": False, "parametrization": "mup",
               "base_width": 32, "scan_layers": False}  # fmt: skip

GPT2_SMALL = {"n_layers": 12, "n_heads": 12, "d_model": 768, "vocab_size": 50257,
              "max_len": 1024, "position": "learned", "norm": "layernorm", "ffn": "gelu_tanh",
              "tie_embeddings": True, "attn_bias": True, "out_bias": True,
              "ffn_bias": True}  # fmt: skip

EMBEDDED_CHARS = {"kind": "text", "path": "", "tokenizer": "char"}

SHAKESPEARE_CHARS = {"kind": "text", "path": "cache:shakespeare", "tokenizer": "char",
                     "max_chars": 0}  # fmt: skip

CHAR_LM_TRAINING = {
    "data": {**EMBEDDED_CHARS, "seq_len": 128, "max_chars": 2_000_000},
    "optim": {"learning_rate": 2e-3, "warmup_steps": 50, "min_lr_ratio": 0.1, "weight_decay": 0.1},
    "train": {"steps": 600, "batch_size": 16, "seed": 0, "log_every_steps": 20},
    "eval": {"every_steps": 100, "batches": 8, "batch_size": 32, "sample_tokens": 160,
             "sample_prompt": "def "},
    "checkpoint": {"every_steps": 200, "max_to_keep": 2},
}  # fmt: skip

STUDY_TRAINING = {
    "data": {**EMBEDDED_CHARS, "max_chars": 1_000_000},
    "optim": {"learning_rate": 3e-3, "warmup_steps": 30, "min_lr_ratio": 0.1, "weight_decay": 0.1},
}
