"""What the experiment files share besides their configs: the tiny CPU twins' run, a few
steps on a few rows, logged at every step, evaluated on one batch and checkpointed at its end
(``tiny_run``), and the twin itself, the model shrunk and the data cut beside that run
(``tiny_twin``); the schedule of a study read once at its end (``eval_at_end``); running a
file's ``main`` as a script (``run_script``); and the pieces of a report: a sweep's finished
trials (``finished_trials``), a report's command line (``report_main``), a mean and its 95%
t-interval over seeds (``interval``), a table's mean ± std cell (``pm``) and a row of
error-bar panels (``errorbar_panels``)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys

from attnlab.errors import AttnlabError

TINY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2}


def tiny_run(c, *, steps: int = 3, batch_size: int = 4, **eval_fields):
    """``c``'s train, eval and checkpoint groups set for a tiny twin: ``steps`` steps of
    ``batch_size`` rows with a log line at each, one evaluation batch of ``batch_size`` rows
    and a checkpoint at the last step; ``eval_fields`` (``sample_tokens=8``, say) join the
    eval group."""
    c.train.update(steps=steps, batch_size=batch_size, log_every_steps=1)
    c.eval.update(every_steps=steps, batches=1, batch_size=batch_size, **eval_fields)
    c.checkpoint.update(every_steps=steps)


def tiny_twin(c, *, seq_len=None, max_chars=None, steps=3, batch_size=4, sample_tokens=None,
              **model):  # fmt: skip
    """``c`` as its tiny CPU twin: the model at ``TINY_MODEL`` (one layer of two heads at
    d_model 32) with ``model``'s fields on top, rows of ``seq_len`` tokens and ``max_chars``
    characters of text where given, and ``tiny_run``'s schedule (``sample_tokens``: that many
    sampled at its evaluation)."""
    c.model.update(TINY_MODEL, **model)
    data = {"seq_len": seq_len, "max_chars": max_chars}
    c.data.update({k: v for k, v in data.items() if v is not None})
    samples = {} if sample_tokens is None else {"sample_tokens": sample_tokens}
    tiny_run(c, steps=steps, batch_size=batch_size, **samples)


def eval_at_end(c, *, steps, batch_size, log_every_steps, eval_batches, eval_batch_size=None,
                **train_fields):  # fmt: skip
    """``c``'s schedule for a study read once at its end: ``steps`` steps of ``batch_size``
    rows (``train_fields`` join the train group), one evaluation of ``eval_batches`` batches
    of ``eval_batch_size`` rows (default ``batch_size``), no samples, and one checkpoint, at
    the last step."""
    c.train.update(steps=steps, batch_size=batch_size, log_every_steps=log_every_steps,
                   **train_fields)  # fmt: skip
    c.eval.update(every_steps=steps, batches=eval_batches,
                  batch_size=eval_batch_size or batch_size, sample_tokens=0)  # fmt: skip
    c.checkpoint.update(every_steps=steps, max_to_keep=1)


def run_script(main, file: str):
    """``main()`` of the experiment file ``file`` run as a script: an expected error (an
    ``AttnlabError``) exits with its message alone, as the ``attnlab`` command does."""
    try:
        main()
    except AttnlabError as e:
        sys.exit(f"{pathlib.Path(file).name}: error: {e}")


def finished_trials(root) -> list[tuple[pathlib.Path, dict]]:
    """``(directory, saved config)`` of each trial under a sweep's ``root`` that has its
    ``config.json``, by name."""
    found = sorted(p for p in pathlib.Path(root).iterdir() if (p / "config.json").is_file())
    return [(p, json.loads((p / "config.json").read_text())) for p in found]


def report_main(report, doc: str, variants, text: str, argv=None, **options):
    """The command line of a sweep's report: ``--report DIR`` (the sweep's directory),
    ``--variant`` (one of ``variants``) and an integer flag per ``options`` entry
    (``rows=(128, "help")``), passed on as ``report(DIR, variant=..., rows=...)``; then
    prints ``DIR/<text>``, the table the report wrote."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--report", metavar="DIR", required=True, help="the sweep's directory")
    p.add_argument("--variant", choices=variants)
    for name, (default, help) in options.items():
        p.add_argument(f"--{name}", type=int, default=default, help=help)
    args = vars(p.parse_args(argv))
    root = args.pop("report")
    report(root, **args)
    print((pathlib.Path(root) / text).read_text())


# Student's t at 97.5% by degrees of freedom (a 95% two-sided interval); 1.96 past 8.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}


def interval(values) -> tuple[float, float, int]:
    """``(mean, 95% t-interval half-width, n)`` of ``values`` (half-width 0 for one value,
    NaNs for none)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = statistics.fmean(values)
    if n == 1:
        return mean, 0.0, 1
    return mean, T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n), n


def pm(mean_std) -> str:
    """A ``(mean, std)`` pair as a table cell, ``0.123 ± 0.004``."""
    return f"{mean_std[0]:.3f} ± {mean_std[1]:.3f}"


def errorbar_panels(path, panels: dict, *, xlabel: str, figsize, xticks=None, xscale=None,
                    ylabel=None, legend_size=None):  # fmt: skip
    """A row of panels saved to ``path``: ``panels`` maps each panel's title to its lines,
    ``{label: (x, y, yerr)}`` or ``(x, y, yerr, linestyle)``, each drawn with error bars
    (``xscale``: ``("log", 2)``, a log axis of that base)."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    for i, (title, lines) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for label, (x, y, e, *style) in lines.items():
            ax.errorbar(x, y, yerr=np.nan_to_num(np.asarray(e, np.float64)), marker="o",
                        capsize=3, label=label, linestyle=(style or ["-"])[0])  # fmt: skip
        if xticks is not None:
            ax.set_xticks(xticks)
        if xscale:
            ax.set_xscale(xscale[0], base=xscale[1])
        ax.set_xlabel(xlabel)
        if ylabel:
            ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
