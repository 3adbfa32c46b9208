"""Scaling ladders (attnlab.sweep.scaling): the plan of a ladder from its budgets, the fits
recovering the exponents of synthetic losses drawn from a known L(N, D) with noise, the
report page, and the bad inputs."""

import json
import math

import numpy as np
import pytest

from attnlab.experiment import ExperimentError
from attnlab.sweep import scaling

# Hoffmann et al. (2022), approach 3's fit: the truth the synthetic losses are drawn from.
TRUTH = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def _loss(n, d):
    return TRUTH["E"] + TRUTH["A"] / n ** TRUTH["alpha"] + TRUTH["B"] / d ** TRUTH["beta"]


def _synthetic(noise=0.003, seed=0):
    """Four IsoFLOP budgets, seven sizes each around the true optimum (closed form below,
    not the code under test), losses with multiplicative noise."""
    rng = np.random.default_rng(seed)
    a, b = TRUTH["alpha"], TRUTH["beta"]
    g = (a * TRUTH["A"] / (b * TRUTH["B"])) ** (1 / (a + b))
    points = []
    for c in np.geomspace(1e18, 1e21, 4):
        n_opt = g * (c / 6) ** (b / (a + b))
        for n in n_opt * np.geomspace(1 / 8, 8, 7):
            d = c / (6 * n)
            points.append(
                (float(c), float(n), float(d), float(_loss(n, d) * rng.lognormal(0, noise)))
            )
    return points


def test_the_fits_recover_the_exponents_of_a_known_law():
    points = _synthetic()
    iso = scaling.fit_isoflop(points)
    a, b = TRUTH["alpha"], TRUTH["beta"]
    assert iso["a"] == pytest.approx(b / (a + b), abs=0.02)  # N_opt ~ C^(beta/(alpha+beta))
    starts = [(5.0, 5.0, 0.5, 0.3, 0.3)]  # one start of the default grid: a fast test
    fit = scaling.fit_loss(points, starts=starts)
    assert fit["alpha"] == pytest.approx(a, abs=0.02)
    assert fit["beta"] == pytest.approx(b, abs=0.02)
    assert fit["E"] == pytest.approx(TRUTH["E"], abs=0.05)


def test_a_ladder_plans_each_budgets_sizes_by_six_n_d():
    sizes = [{"model.d_model": d} for d in (16, 32, 64, 128)]
    n = [1000, 4000, 16000, 64000]
    rungs = scaling.plan_ladder([1e9, 4e9], sizes, n, 100, min_steps=20, max_steps=2000)
    for r in rungs:
        assert r.steps == round(r.budget / (6 * r.n_params) / 100) and 20 <= r.steps <= 2000
        assert r.tokens == r.steps * 100
    # 1e9 / (6 N 100) = 1667, 417, 104, 26 steps; 4e9: 6667 (over 2000), 1667, 417, 104
    assert [(r.budget, r.n_params) for r in rungs] == [
        (1e9, 1000), (1e9, 4000), (1e9, 16000), (1e9, 64000), (4e9, 4000), (4e9, 16000),
        (4e9, 64000),
    ]  # fmt: skip


def test_a_ladder_budget_too_small_for_the_smallest_model_is_one_line():
    with pytest.raises(ExperimentError, match=r"ladder budget 1e\+06 FLOPs is too small"):
        scaling.plan_ladder([1e6], [{"model.d_model": 16}], [1000], 100, min_steps=20)


@pytest.mark.slow(reason="draws the report's figure with matplotlib")
def test_the_report_page_lists_the_best_values_per_width_and_the_fits(tmp_path):
    from attnlab.sweep.report import write_report

    trials = []
    for width, best in ((32, 0.01), (64, 0.01)):
        for lr in (0.005, 0.01, 0.02):
            for seed in (0, 1):
                name = f"model.d_model={width},optim.learning_rate={lr},train.seed={seed}"
                overrides = {"model.d_model": width, "optim.learning_rate": lr,
                             "train.seed": seed}  # fmt: skip
                d = tmp_path / name
                d.mkdir()
                loss = 2.0 + abs(math.log2(lr / best)) - width / 1000 + seed * 1e-3
                (d / "metrics.jsonl").write_text(
                    json.dumps({"step": 10, "train_loss": loss, "eval_loss": loss}) + "\n"
                )
                (d / "status.json").write_text(json.dumps({"status": "finished"}))
                trials.append({"name": name, "overrides": overrides})
    (tmp_path / "sweep.json").write_text(json.dumps({"config": "x", "overrides": [],
                                                     "trials": trials}))  # fmt: skip
    paths = write_report(tmp_path)
    page = (tmp_path / "report.md").read_text()
    assert "| 32 | 0.01 |" in page and "| 64 | 0.01 |" in page  # best rate per width
    assert all(p.exists() for p in paths)


@pytest.mark.slow(reason="Optuna's fANOVA fits a random forest")
def test_optuna_importances_rank_the_parameter_the_objective_follows():
    import optuna

    from attnlab.sweep.report import study_importances

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    rate = optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)
    noise = optuna.distributions.FloatDistribution(0.0, 1.0)
    rng = np.random.default_rng(0)
    for _ in range(20):  # the objective follows the rate alone
        lr, other = float(np.exp(rng.uniform(-6.9, -2.3))), float(rng.uniform())
        study.add_trial(optuna.trial.create_trial(
            params={"lr": lr, "other": other}, distributions={"lr": rate, "other": noise},
            value=abs(math.log(lr / 0.01)),
        ))  # fmt: skip
    importances = study_importances(study)
    assert importances["lr"] > importances["other"]
