"""Hyperparameter sweeps: specifications as code, resumable runs, vmap-parallel trials, results.

An experiment file may define ``sweep(variant=None)`` beside ``get_config`` returning a list of
override dicts, built by hand or with ``grid``, ``random_search`` and ``product``::

    from attnlab.sweep import grid

    def sweep(variant=None):
        return grid({"optim.learning_rate": [3e-4, 1e-3, 3e-3], "train.seed": [0, 1, 2]})

``attnlab sweep --config experiments/NAME.py --workdir DIR`` trains each trial in ``DIR/<trial>``
(trials that differ only in stackable values as one stacked program: vmapped on an
accelerator, mapped on CPU), then writes ``DIR/results.{csv,json}`` and plots. A ``sweep``
may instead return ``optuna_search(space, num_trials, sampler=..., pruner=...)``: Optuna
suggests the trials, which train stacked where they can and are pruned inside their stack
(``attnlab.sweep.search``). See docs/sweeps.md.
"""

from attnlab.sweep.plan import (
    Group,
    Plan,
    Trial,
    apply_overrides,
    commands,
    group_trials,
    plan_sweep,
    train_argv,
)
from attnlab.sweep.results import collect, markdown_table, plot_final_metric, write_results
from attnlab.sweep.run import (
    TrialsFailed,
    check_failed,
    plan_actions,
    read_status,
    run_sweep,
    summary_line,
    trial_action,
    write_manifest,
)
from attnlab.sweep.search import (
    Search,
    SearchPlan,
    load_sweep,
    optuna_search,
    plan_search,
    run_search,
)
from attnlab.sweep.spec import (
    as_trials,
    choice,
    format_value,
    grid,
    log_uniform,
    product,
    random_search,
    trial_name,
    uniform,
)

__all__ = [
    "Group",
    "TrialsFailed",
    "Plan",
    "Search",
    "SearchPlan",
    "Trial",
    "apply_overrides",
    "as_trials",
    "check_failed",
    "choice",
    "collect",
    "commands",
    "format_value",
    "grid",
    "group_trials",
    "load_sweep",
    "log_uniform",
    "markdown_table",
    "optuna_search",
    "plan_actions",
    "plan_search",
    "plan_sweep",
    "plot_final_metric",
    "product",
    "random_search",
    "read_status",
    "run_search",
    "run_sweep",
    "summary_line",
    "train_argv",
    "trial_action",
    "trial_name",
    "uniform",
    "write_manifest",
    "write_results",
]
