"""Sweep plots: by swept value with mean +- std over seeds, no offsets, no reused colours."""

import statistics

import numpy as np

from attnlab.sweep import plot_final_metric
from attnlab.viz import distinct_colors


def _results(values):
    trials = [
        {
            "trial": f"t{i}",
            "status": "finished",
            "overrides": dict(overrides),
            "final_eval_loss": loss,
            "final_train_loss": loss,
        }
        for i, (overrides, loss) in enumerate(values)
    ]
    keys = list(dict.fromkeys(k for o, _ in values for k in o))
    return {"keys": keys, "trials": trials, "aggregates": []}


def test_final_metric_groups_by_value_with_bands_over_seeds():
    losses = {(lr, s): 1.2 + lr * 100 + 0.0003 * s for lr in (1e-3, 3e-3) for s in (0, 1, 2)}
    fig = plot_final_metric(
        _results(
            [({"optim.learning_rate": lr, "train.seed": s}, v) for (lr, s), v in losses.items()]
        )
    )
    (ax,) = fig.axes  # the seed is not an x axis of its own
    assert ax.get_xlabel() == "optim.learning_rate"
    line = ax.containers[0].lines[0]  # the means by swept value, with std error bars
    mean_3e3 = statistics.fmean(v for (lr, _), v in losses.items() if lr == 3e-3)
    assert np.allclose(line.get_ydata(), [mean_3e3 - 0.2, mean_3e3])
    assert ax.collections  # the std band and the seeds' points
    fig.canvas.draw()
    assert ax.yaxis.get_major_formatter().get_offset() == ""


def test_a_seed_only_sweep_draws_no_line_across_seeds():
    fig = plot_final_metric(_results([({"train.seed": s}, 1.5 + 0.0006 * s) for s in range(3)]))
    (ax,) = fig.axes
    joined = [ln for ln in ax.get_lines() if len(set(np.asarray(ln.get_ydata()))) > 1]
    assert not joined  # only the flat mean line and the band
    fig.canvas.draw()
    assert ax.yaxis.get_major_formatter().get_offset() == ""


def test_distinct_colours_never_repeat():
    for n in (3, 12, 40):
        colours = [str(c) for c in distinct_colors(n)]
        assert len(set(colours)) == n
