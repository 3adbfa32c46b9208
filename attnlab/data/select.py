"""``make_task``: the data kind a config names, built by its builder from one table.

Text corpora and the synthetic tasks live in ``tasks``, prepared token files in ``prepared``;
this module is the one place that knows both, so neither imports the other.
"""

from __future__ import annotations

from attnlab.data import prepared, tasks
from attnlab.errors import DataError

BUILDERS = {
    "text": lambda cfg, workdir, host: tasks.text_task(cfg, workdir, mlm=False, host=host),
    "mlm_text": lambda cfg, workdir, host: tasks.text_task(cfg, workdir, mlm=True, host=host),
    "prepared": lambda cfg, workdir, host: prepared.prepared_task(cfg, workdir, host=host),
}


def make_task(data_cfg, workdir=None, host=(0, 1)) -> tasks.Task:
    """Build the task ``data_cfg.kind`` names (``data_cfg``: a mapping or attribute object).

    Fields read (missing or None = the default): kind, path ("" = the embedded standard-library
    corpus), tokenizer ("char" | "byte"), seq_len, val_fraction, num_symbols, min_len, max_len
    (0 = the largest that fits seq_len), mask_rate, max_chars (<= 0 = no limit), vocab_size
    (of a "bpe" tokenizer). With a ``workdir`` the tokenizer is written to
    ``workdir/tokenizer.json`` on the first call and read back on later ones. ``kind="prepared"``
    reads a directory written by ``attnlab data prepare`` (``data.path``), memory-mapped.
    ``host`` = (process index, process count): which rows of each training batch to read.
    """
    name = tasks.config_field(data_cfg, "kind")
    if name not in tasks.TASK_KINDS:
        raise DataError(f"data.kind must be one of {', '.join(tasks.TASK_KINDS)}; got {name!r}")
    build = BUILDERS.get(name)
    return tasks.synthetic_task(data_cfg) if build is None else build(data_cfg, workdir, host)
