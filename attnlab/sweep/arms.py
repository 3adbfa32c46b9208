"""Arms x seeds: the harness of an experiment that compares a few variants of one config.

An experiment file keeps its config, its arms (``{arm: model changes}``), what it measures
of a trained run, and its table and figure; this module trains every arm at every seed,
turns the numbers into mean ± sample std, and writes the results::

    def main(argv=None):
        a = arms.parser(__doc__).parse_args(argv)
        seeds, steps = arms.seeds_and_steps(a, SEEDS)
        runs = arms.train_arms(get_config, ARMS, a.run, seeds=seeds, steps=steps,
                               measure=summary)
        arms.report(a.run, "gated", runs, table=table, markdown=markdown, plot=plot,
                    figure=IMAGES / "gated_attention.png", n_seeds=len(seeds), quick=a.quick)

Each run trains in ``DIR/<arm>_s<seed>`` (``attnlab.runs.train``, which resumes a run that
stopped and trains nothing for one that finished); ``DIR/<name>.json`` holds the runs and
the table, ``DIR/<name>.md`` the table as text, and the figure goes to the docs (to
``DIR`` under ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable, Iterable

import numpy as np

QUICK_STEPS = 60  # --quick: this many steps, the first seed alone


def mean_std(xs) -> tuple[float, float]:
    """The mean and the sample standard deviation (0.0 for a single value)."""
    xs = np.asarray(xs, np.float64)
    return float(xs.mean()), float(xs.std(ddof=1)) if len(xs) > 1 else 0.0


def train_arms(
    get_config: Callable,
    arms: dict[str, dict],
    root,
    *,
    seeds: Iterable[int],
    steps: int | None = None,
    measure: Callable[[dict, pathlib.Path], dict],
    reopen: bool = False,
) -> dict[str, list[dict]]:
    """``{arm: [measure(record, workdir) for each seed]}``: ``get_config()`` with the arm's
    model changes and the seed, trained in ``root/<arm>_s<seed>`` (``steps``: that many
    steps, evaluated and saved at the last). ``record`` is the run's final log line;
    ``reopen`` trains nothing and reads it from the finished run instead."""
    from attnlab.runs import load_run, train

    root = pathlib.Path(root)
    runs: dict[str, list[dict]] = {}
    for arm, model in arms.items():
        for seed in seeds:
            cfg = get_config()
            cfg.model.update(model)
            cfg.train.seed = seed
            if steps:
                cfg.train.steps = steps
                cfg.eval.every_steps = cfg.checkpoint.every_steps = steps
            workdir = root / f"{arm}_s{seed}"
            if reopen:
                record = load_run(workdir).metrics[-1]
            else:
                record = train(cfg, workdir, progress=False)
            runs.setdefault(arm, []).append(measure(record, workdir))
    return runs


def parser(doc: str) -> argparse.ArgumentParser:
    """The command line every arms experiment takes: ``--run DIR`` and ``--quick``."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--run", required=True, help="the directory of the runs and results")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps, one seed")
    return p


def seeds_and_steps(args, seeds: tuple[int, ...]) -> tuple[tuple[int, ...], int | None]:
    """The seeds and steps to train: the first seed for ``QUICK_STEPS`` under ``--quick``,
    else every seed for the config's own steps."""
    return ((seeds[0],), QUICK_STEPS) if args.quick else (tuple(seeds), None)


def read_runs(root, name: str) -> dict[str, list[dict]]:
    """The runs that ``report`` wrote to ``root/<name>.json``."""
    return json.loads((pathlib.Path(root) / f"{name}.json").read_text())["runs"]


def report(root, name: str, runs, *, table, markdown, plot, figure, n_seeds: int, quick: bool):
    """``table(runs)`` written with the runs to ``root/<name>.json``, ``markdown(table,
    n_seeds)`` to ``root/<name>.md`` and printed, and ``plot(table, path)`` drawn to
    ``figure`` (to ``root`` under ``quick``). Returns the table."""
    root, figure = pathlib.Path(root), pathlib.Path(figure)
    t = table(runs)
    text = markdown(t, n_seeds)
    (root / f"{name}.json").write_text(json.dumps({"runs": runs, "table": t}, indent=2))
    (root / f"{name}.md").write_text(text)
    plot(t, root / figure.name if quick else figure)
    print(text)
    return t
