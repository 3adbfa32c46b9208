"""Data: tokenizers, corpora, synthetic tasks and NumPy batches (see ``tasks`` for formats)."""

from attnlab.data import corpus, synthetic, tasks, tokenizers
from attnlab.data.corpus import load_text, split_train_val, stdlib_corpus
from attnlab.data.select import make_task
from attnlab.data.tasks import TASK_KINDS, Task, batch_rng
from attnlab.data.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer, validate_ids

__all__ = [
    "TASK_KINDS",
    "ByteTokenizer",
    "CharTokenizer",
    "Task",
    "batch_rng",
    "corpus",
    "load_text",
    "load_tokenizer",
    "make_task",
    "split_train_val",
    "stdlib_corpus",
    "synthetic",
    "tasks",
    "tokenizers",
    "validate_ids",
]
