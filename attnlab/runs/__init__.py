"""Runs: the work directory, the training loop, stacked trials, run loading and evaluation.

``train(cfg, workdir)`` trains (or resumes) one experiment in a work directory;
``train_stacked`` trains runs that differ only in ``STACKABLE`` values as one vmapped program;
``load_run`` reopens a run from its latest checkpoint as a ``Run`` (``evaluate``
evaluates one). The steps themselves come from ``attnlab.train``; the work directory's own
handle (locking, checkpoints, logs) is ``attnlab.runs.workdir.Run``.
"""

from attnlab import _moved
from attnlab.runs.files import CONFIG_FILE, METRICS_FILE, SAMPLES_FILE
from attnlab.runs.loading import Run, evaluate, load_run, saved_config
from attnlab.runs.loop import Pruned, mask_row, open_runs, train, train_runs
from attnlab.runs.progress import Progress
from attnlab.runs.sampling import (
    continuation,
    decode_known,
    default_prompt,
    sample_text,
    seq2seq_continuation,
    unknown_ids,
)
from attnlab.runs.stacked import STACKABLE, stack_key, train_stacked
from attnlab.runs.workdir import (
    append_jsonl,
    atomic_write,
    check_config,
    truncate_jsonl,
)

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "SAMPLES_FILE",
    "STACKABLE",
    "Progress",
    "Pruned",
    "Run",
    "append_jsonl",
    "atomic_write",
    "check_config",
    "continuation",
    "decode_known",
    "default_prompt",
    "evaluate",
    "load_run",
    "mask_row",
    "open_runs",
    "sample_text",
    "saved_config",
    "seq2seq_continuation",
    "stack_key",
    "train",
    "train_runs",
    "train_stacked",
    "truncate_jsonl",
    "unknown_ids",
]


__getattr__ = _moved.module_getattr(__name__)  # the previous release's names, deprecated
