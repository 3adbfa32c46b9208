"""The RULER-style tasks as an lm-eval task folder (``attnlab eval --write-harness DIR``).

``write_tasks(folder, tasks, lengths, encode, decode)`` writes, per task and length, the
examples as ``<task>_<length>.jsonl`` (``input``: the prompt text, ending with the answer
prefix; ``outputs``: the references) and a task ``ruler_<task>_<length>.yaml`` (greedy
``generate_until`` a newline, scored by ``recall``: the fraction of references the output
holds, as ``attnlab eval --tasks`` scores it), all tagged ``ruler_attnlab``, with ``utils.py``
beside them. Lengths are counted in the tokens of ``encode`` (a model's tokenizer; bytes by
default), so write the folder with the tokenizer of the model it will score. Any harness
user runs it with::

    lm_eval --model hf --model_args pretrained=DIR --include_path FOLDER --tasks ruler_attnlab
    attnlab eval --harness ruler_attnlab --pretrained DIR --include-path FOLDER
"""

from __future__ import annotations

import json
import pathlib

from attnlab.data import ruler_tasks
from attnlab.errors import ConfigError

TAG = "ruler_attnlab"
UTILS = '''"""Scoring of the attnlab RULER-style tasks: the fraction of references in the output."""


def process_results(doc, results):
    prediction = results[0].split("\\n")[0]
    found = sum(ref in prediction for ref in doc["outputs"])
    return {"recall": found / len(doc["outputs"])}
'''


def _yaml(name, data_file, max_gen_toks):
    return (
        f"task: {name}\ntag: {TAG}\ndataset_path: json\ntest_split: test\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data_file}\n"
        "output_type: generate_until\ndoc_to_text: '{{input}}'\n"
        "doc_to_target: '{{outputs[0]}}'\ntarget_delimiter: ''\n"
        f"generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: {max_gen_toks}\n"
        "  do_sample: false\n"
        "process_results: !function utils.process_results\n"
        "metric_list:\n  - metric: recall\n    aggregation: mean\n    higher_is_better: true\n"
    )


def write_tasks(folder, tasks, lengths, encode, decode, *, examples=32, seed=0, lines=None):
    """Writes the task folder; returns the task names written (tasks that do not fit a
    length are left out)."""
    from attnlab.evaluation.ruler import haystack_lines

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = haystack_lines() if lines is None else lines
    (folder / "utils.py").write_text(UTILS)
    written = []
    for task in ruler_tasks.task_names(tasks):
        for n in sorted(int(x) for x in lengths):
            try:
                exs = ruler_tasks.examples(task, n, examples, encode, seed=seed, corpus_lines=lines)
            except ConfigError:
                continue
            name = f"ruler_{task}_{n}"
            data = folder / f"{task}_{n}.jsonl"
            rows = [
                {"input": decode(e.prompt), "outputs": list(e.references), "length": n} for e in exs
            ]
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            new = max(len(e.target) for e in exs) + 2
            (folder / f"{name}.yaml").write_text(_yaml(name, data.resolve(), new))
            written.append(name)
    return written
