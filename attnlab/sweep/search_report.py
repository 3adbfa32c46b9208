"""What an Optuna search leaves in its directory: the manifest of its trials, ``best.json``
and the plots of parameter importances and parallel coordinates."""

from __future__ import annotations

import json
import pathlib

from attnlab import experiment, runs
from attnlab.sweep.plan import apply_overrides
from attnlab.sweep.run import SWEEP_FILE

BEST_FILE = "best.json"


def final_value(trial_dir, metric):
    path = trial_dir / runs.METRICS_FILE
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    values = [r[metric] for r in rows if metric in r]
    return float(values[-1]) if values else None


def write_manifest(plan, root, study):
    trials, named = [], set()
    for f in study.get_trials(deepcopy=False):  # a retried trial shares its directory
        name, values = f.user_attrs.get("dir"), f.user_attrs.get("overrides")
        if None not in (name, values) and (root / name).parent == root and name not in named:
            named.add(name)  # (another worker may be between setting one and the other)
            trials.append({"name": name, "overrides": values})
    manifest = {"config": plan.config, "overrides": list(plan.base_overrides), "trials": trials}
    runs.atomic_write(root / SWEEP_FILE, json.dumps(manifest, indent=2) + "\n")


def write_best(study, plan, root, log) -> dict | None:
    """``DIR/best.json``: the best trial's number, directory, value, parameters and config."""
    try:
        best = study.best_trial
    except ValueError:
        log("search: no trial finished; no best trial yet")
        return None
    overrides = best.user_attrs.get("overrides", best.params)
    cfg = apply_overrides(plan.base, overrides)
    record = {
        "number": best.number,
        "trial": best.user_attrs.get("dir"),
        "value": best.value,
        "metric": plan.search.metric,
        "params": best.params,
        "overrides": overrides,
        "config": json.loads(experiment.to_json(cfg)),
    }
    runs.atomic_write(root / BEST_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n")
    log(
        f"best: trial {best.number} ({record['trial']}), {plan.search.metric} {best.value:.4f}, "
        + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items()
        )
    )
    return record


def write_plots(study, root, log) -> list[pathlib.Path]:
    """Optuna's parameter importances and parallel coordinates, as PNG (where they apply)."""
    from optuna.visualization import matplotlib as ovm

    paths = []
    for name, plot in (
        ("param_importances.png", ovm.plot_param_importances),
        ("parallel_coordinate.png", ovm.plot_parallel_coordinate),
    ):
        try:
            fig = plot(study).figure
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            log(f"search: no {name} ({e})")
            continue
        fig.set_size_inches(8, 4.5)
        fig.tight_layout()
        fig.savefig(root / name, dpi=110)
        import matplotlib.pyplot as plt

        plt.close(fig)
        paths.append(root / name)
    return paths
