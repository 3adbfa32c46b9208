"""``make_task``: the data kind a config names, built by its builder from one table.

Text corpora live in ``text``, the synthetic tasks in ``tasks``, prepared token files in
``prepared`` and Hugging Face data sets (``data.source="hf_datasets"``) in ``hf_datasets``;
this module is the one place that knows them all.
"""

from __future__ import annotations

from attnlab.data import prepared, tasks, text
from attnlab.errors import DataError

BUILDERS = {
    "text": lambda cfg, workdir, host: text.text_task(cfg, workdir, mlm=False, host=host),
    "mlm_text": lambda cfg, workdir, host: text.text_task(cfg, workdir, mlm=True, host=host),
    "prepared": lambda cfg, workdir, host: prepared.prepared_task(cfg, workdir, host=host),
    "length_task": lambda cfg, workdir, host: _length_task(cfg, workdir, host),
}


def _length_task(cfg, workdir, host):
    from attnlab.data.length_tasks import length_task

    return length_task(cfg, workdir, host)


def _hf_datasets(cfg, workdir, host):
    from attnlab.data.hf_datasets import hf_task  # imports the datasets library on use

    return hf_task(cfg, workdir, host=host)


SOURCES = {"": None, "hf_datasets": _hf_datasets}


def make_task(data_cfg, workdir=None, host=(0, 1)) -> tasks.Task:
    """Build the task ``data_cfg.kind`` names (``data_cfg``: a mapping or attribute object).

    Fields read (missing or None = the default): kind, path ("" = the embedded standard-library
    corpus), tokenizer ("char" | "byte"), seq_len, val_fraction, num_symbols, min_len, max_len
    (0 = the largest that fits seq_len), mask_rate, max_chars (<= 0 = no limit), vocab_size
    (of a "bpe" tokenizer). With a ``workdir`` the tokenizer is written to
    ``workdir/tokenizer.json`` on the first call and read back on later ones. ``kind="prepared"``
    reads a directory written by ``attnlab data prepare`` (``data.path``), memory-mapped.
    ``host`` = (process index, process count): which rows of each training batch to read.
    ``source="hf_datasets"`` reads ``path`` as a Hugging Face data set on disk and its
    ``text_field`` column as the text (``attnlab.data.hf_datasets``).
    """
    source = tasks.config_field(data_cfg, "source")
    if source not in SOURCES:
        known = ", ".join(repr(k) for k in SOURCES)
        raise DataError(f"data.source must be one of {known}; got {source!r}")
    if SOURCES[source] is not None:
        return SOURCES[source](data_cfg, workdir, host)
    name = tasks.config_field(data_cfg, "kind")
    if name not in tasks.TASK_KINDS:
        raise DataError(f"data.kind must be one of {', '.join(tasks.TASK_KINDS)}; got {name!r}")
    build = BUILDERS.get(name)
    return tasks.synthetic_task(data_cfg) if build is None else build(data_cfg, workdir, host)
