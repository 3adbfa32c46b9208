"""Attention transfer: a pretrained Transformer turned into any mixer by distillation and
LoRA (LoLCATs' two stages), measured against its teacher.

``plan``: the teacher (a Hugging Face folder or an attnlab run) and the layer plan;
``stages``: one stage trained against the frozen teacher in the same program, resumable;
``measure``: loss, passkey retrieval, decode speed and cache bytes; ``pipeline.run``: the
whole recipe in a work directory (``experiments/attention_transfer.py``).
"""

from attnlab.transfer.pipeline import check, run

__all__ = ["check", "run"]
