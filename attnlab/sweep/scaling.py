"""Scaling ladders: compute budgets -> (parameters, tokens) per budget -> a sweep -> IsoFLOP
curves -> fits of L(N, D) -> a prediction for a larger budget -> the run that checks it.

``plan_ladder`` turns budgets ``C`` (FLOPs, ``C = 6 N D``) and a size dial (a list of model
overrides, smallest first) into trials: each size whose token count ``D = C / (6 N)`` needs
between ``min_steps`` and ``max_steps`` steps trains at that budget (``N``: the parameters
other than the token and position tables, from the shapes). Variants (dicts of overrides)
put several models on the same ladder.

The fits follow Hoffmann et al. (2022, "Chinchilla"):

* approach 2 (``fit_isoflop``): per budget a parabola of the loss in ``log N``, its minimum
  the budget's compute-optimal ``N``; then ``N_opt = k C^a`` by least squares in log-log.
* approach 3 (``fit_loss``): ``L(N, D) = E + A / N^alpha + B / D^beta`` by minimising the
  Huber loss (delta 1e-3) of the log-sum-exp form against ``log L`` from a grid of starts
  (``scipy.optimize.minimize``, BFGS with the analytic gradient: on these 5 parameters it
  reached lower minima than L-BFGS-B at its default tolerances, and each start took
  milliseconds where L-BFGS-B's took hundreds on the loaded 2-core machine); the compute-optimal
  ``N_opt(C) = G (C/6)^(beta/(alpha+beta))``, ``G = (alpha A / (beta B))^(1/(alpha+beta))``.

``bootstrap`` refits on trials resampled with replacement (within each budget) and gives
percentile intervals of the exponents and of the predictions at a target budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from attnlab.experiment import ExperimentError

HUBER_DELTA = 1e-3


# The ladder ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rung:
    """One trial of a ladder: its budget, the size's overrides, N, D and steps."""

    budget: float
    size: dict
    n_params: int
    tokens: int
    steps: int
    variant: str = ""


def scaling_params(mcfg) -> int:
    """N: the parameters other than the token and position tables (Kaplan et al.'s
    non-embedding count; the output head counts when untied)."""
    import jax
    from flax import nnx

    from attnlab.nn.models import MODEL_CLASSES

    abstract = nnx.eval_shape(lambda: MODEL_CLASSES[mcfg.arch](mcfg, rngs=nnx.Rngs(0)))
    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(abstract, nnx.Param))[0]:
        name = jax.tree_util.keystr(path)
        if "embedding_VD" not in name and "table_PD" not in name:
            total += x.size
    return int(total)


def plan_ladder(
    budgets, sizes, n_params, tokens_per_step: int, *, min_steps: int = 40,
    max_steps: int | None = None, min_sizes: int = 3,
) -> list[Rung]:  # fmt: skip
    """The rungs of each budget: every size (``sizes[i]`` with ``n_params[i]`` parameters)
    whose ``D = C / (6 N)`` tokens take ``min_steps`` to ``max_steps`` steps of
    ``tokens_per_step``. A budget too small for the smallest model, or with fewer than
    ``min_sizes`` sizes on it, is an ``ExperimentError`` naming it."""
    if not budgets or not sizes or len(sizes) != len(n_params):
        raise ExperimentError("ladder: give budgets, and sizes with their parameter counts")
    rungs = []
    smallest = min(n_params)
    for budget in sorted(float(b) for b in budgets):
        need = 6 * smallest * tokens_per_step * min_steps
        if budget < need:
            raise ExperimentError(
                f"ladder budget {budget:.3g} FLOPs is too small for the smallest model "
                f"(N={smallest}: {min_steps} steps of {tokens_per_step} tokens need "
                f"{need:.3g} FLOPs); raise the budget or add a smaller size"
            )
        on = []
        for size, n in zip(sizes, n_params, strict=True):
            steps = round(budget / (6 * n) / tokens_per_step)
            if steps >= min_steps and (max_steps is None or steps <= max_steps):
                on.append(Rung(budget, dict(size), int(n), steps * tokens_per_step, steps))
        if len(on) < min_sizes:
            raise ExperimentError(
                f"ladder budget {budget:.3g} FLOPs fits {len(on)} size(s) between {min_steps} "
                f"and {max_steps} steps; an IsoFLOP curve needs {min_sizes}: widen the sizes "
                "or the step range"
            )
        rungs += on
    return rungs


# Approach 2 ---------------------------------------------------------------------------------
def isoflop_minima(points) -> list[tuple[float, float, float]]:
    """``[(C, N_opt, L_min)]``: each budget's parabola in ``log N`` and its minimum (budgets
    whose parabola opens downwards, whose minimum lies outside the sizes trained, or with
    fewer than 3 distinct sizes are left out: the curve does not bracket its optimum)."""
    out = []
    for budget, group in itertools.groupby(sorted(points), key=lambda p: p[0]):
        group = list(group)
        logn = np.log([p[1] for p in group])
        loss = np.array([p[3] for p in group])
        if len(set(logn)) < 3:
            continue
        a, b, c = np.polyfit(logn, loss, 2)
        if a <= 0:
            continue
        x = -b / (2 * a)
        if not logn.min() <= x <= logn.max():
            continue
        out.append((budget, float(math.exp(x)), float(a * x * x + b * x + c)))
    return out


def fit_isoflop(points) -> dict:
    """Approach 2 on ``points`` ``[(C, N, D, L)]``: ``{"a", "k", "minima"}`` with
    ``N_opt = k C^a`` (so ``D_opt`` grows as ``C^(1-a)``)."""
    minima = isoflop_minima(points)
    if len(minima) < 2:
        return {"a": None, "k": None, "minima": minima}
    a, logk = np.polyfit(np.log([m[0] for m in minima]), np.log([m[1] for m in minima]), 1)
    return {"a": float(a), "k": float(math.exp(logk)), "minima": minima}


# Approach 3 ---------------------------------------------------------------------------------
def _huber(r, delta=HUBER_DELTA):
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def _objective(theta, logn, logd, logl):
    """The Huber loss of the log-sum-exp prediction of ``log L`` and its gradient."""
    a, b, e, alpha, beta = theta
    z = np.stack([a - alpha * logn, b - beta * logd, np.full_like(logn, e)])
    top = z.max(axis=0)
    ez = np.exp(z - top)
    total = ez.sum(axis=0)
    r = top + np.log(total) - logl
    w = ez / total
    h = np.clip(r, -HUBER_DELTA, HUBER_DELTA)  # the Huber loss's derivative
    grad = [np.sum(h * w[0]), np.sum(h * w[1]), np.sum(h * w[2]),
            -np.sum(h * w[0] * logn), -np.sum(h * w[1] * logd)]  # fmt: skip
    return float(np.sum(_huber(r))), np.array(grad)


def fit_loss(points, starts=None) -> dict:
    """Approach 3 on ``points`` ``[(C, N, D, L)]``: ``{"E", "A", "B", "alpha", "beta"}``,
    the best of BFGS runs from a grid of starts (Chinchilla's grid, smaller)."""
    from scipy.optimize import minimize

    pts = np.asarray([(p[1], p[2], p[3]) for p in points], float)
    logn, logd, logl = np.log(pts[:, 0]), np.log(pts[:, 1]), np.log(pts[:, 2])
    if starts is None:
        starts = itertools.product((0.0, 6.0), (0.0, 6.0), (-1.0, 0.5),
                                   (0.2, 0.6), (0.2, 0.6))  # fmt: skip
    run = lambda x0: minimize(
        _objective, np.asarray(x0, float), args=(logn, logd, logl), jac=True, method="BFGS"
    )
    best = min((run(s) for s in starts), key=lambda r: r.fun)
    a, b, e, alpha, beta = best.x
    return {"E": math.exp(e), "A": math.exp(a), "B": math.exp(b), "alpha": float(alpha),
            "beta": float(beta), "theta": [float(v) for v in best.x]}  # fmt: skip


def loss_at(fit: dict, n, d):
    return fit["E"] + fit["A"] / np.power(n, fit["alpha"]) + fit["B"] / np.power(d, fit["beta"])


def optimal(fit: dict, budget: float) -> tuple[float, float, float]:
    """``(N_opt, D_opt, L_opt)`` at ``budget`` FLOPs under an approach-3 fit."""
    alpha, beta = fit["alpha"], fit["beta"]
    g = (alpha * fit["A"] / (beta * fit["B"])) ** (1 / (alpha + beta))
    n = g * (budget / 6) ** (beta / (alpha + beta))
    d = budget / (6 * n)
    return float(n), float(d), float(loss_at(fit, n, d))


# Bootstrap ----------------------------------------------------------------------------------
def bootstrap(points, target: float, *, samples: int = 100, seed: int = 0, check=None) -> dict:
    """Percentile intervals (5-95 %) over fits to ``points`` resampled with replacement
    within each budget: the exponents of both approaches and their predictions at the
    ``target`` budget (``check``: an ``(N, D)`` whose approach-3 loss is also predicted)."""
    rng = np.random.default_rng(seed)
    by_budget: dict = {}
    for p in points:
        by_budget.setdefault(p[0], []).append(p)
    full = fit_loss(points)
    keys = ("a", "alpha", "beta", "n_opt2", "n_opt3", "l_opt3", "l_check")
    draws = {k: [] for k in keys}
    for _ in range(samples):
        sample = [g[i] for g in by_budget.values() for i in rng.integers(0, len(g), len(g))]
        iso = fit_isoflop(sample)
        fit = fit_loss(sample, starts=[full["theta"]])
        n3, _, l3 = optimal(fit, target)
        draws["a"].append(iso["a"])
        draws["alpha"].append(fit["alpha"])
        draws["beta"].append(fit["beta"])
        draws["n_opt2"].append(iso["k"] * target ** iso["a"] if iso["a"] is not None else None)
        draws["n_opt3"].append(n3)
        draws["l_opt3"].append(l3)
        draws["l_check"].append(float(loss_at(fit, *check)) if check else None)
    out = {}
    for k, v in draws.items():
        v = [x for x in v if x is not None and math.isfinite(x)]
        out[k] = [float(np.percentile(v, 5)), float(np.percentile(v, 95))] if v else None
    return out


def analyse(points, target: float, *, samples: int = 100, check=None) -> dict:
    """Both approaches' fits on ``points`` and their predictions at ``target`` FLOPs, with
    bootstrap intervals."""
    iso = fit_isoflop(points)
    fit = fit_loss(points)
    n3, d3, l3 = optimal(fit, target)
    n2 = iso["k"] * target ** iso["a"] if iso["a"] is not None else None
    return {
        "approach2": iso,
        "approach3": {k: v for k, v in fit.items() if k != "theta"},
        "target": target,
        "predicted": {"n_opt2": n2, "n_opt3": n3, "d_opt3": d3, "l_opt3": l3},
        "intervals": bootstrap(points, target, samples=samples, check=check),
    }


# Reading a ladder's sweep --------------------------------------------------------------------
def ladder_points(ladder: dict, results: dict) -> dict:
    """``{variant: [(C, N, D, L)]}`` of the ladder's finished trials (not the check runs)."""
    loss = {r["trial"]: r["final_eval_loss"] for r in results["trials"]
            if r["status"] == "finished" and r["final_eval_loss"] is not None}  # fmt: skip
    out: dict = {}
    for rung in ladder["rungs"]:
        if rung["trial"] in loss and not rung.get("check"):
            out.setdefault(rung["variant"], []).append(
                (rung["budget"], rung["n_params"], rung["tokens"], loss[rung["trial"]])
            )
    return out


def fit_lines(ladder: dict, results: dict) -> list[str]:
    """The Markdown of a ladder's fits and checks (``ladder["analysis"]``), for the report."""
    lines = ["## Scaling ladder", ""]
    analysis = ladder.get("analysis", {})
    head = ["variant", "approach 2: N_opt ~ C^a", "approach 3: alpha", "beta", "E",
            f"predicted N_opt at {ladder.get('target', 0):.3g}", "predicted loss"]  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def iv(x, digits=3):
        return "" if not x else f" [{x[0]:.{digits}g}, {x[1]:.{digits}g}]"

    for variant, a in analysis.items():
        p, i, f = a["predicted"], a["intervals"], a["approach3"]
        a2 = a["approach2"]["a"]
        lines.append(
            f"| {variant} | {'' if a2 is None else f'{a2:.3f}'}{iv(i.get('a'))} | "
            f"{f['alpha']:.3f}{iv(i.get('alpha'))} | {f['beta']:.3f}{iv(i.get('beta'))} | "
            f"{f['E']:.3f} | {p['n_opt3']:.3g}{iv(i.get('n_opt3'))} | "
            f"{p['l_opt3']:.4f}{iv(i.get('l_opt3'), 4)} |"
        )
    checks = ladder.get("checks", {})
    if checks:
        lines += ["", "| variant | check run (N, D) | predicted loss | measured | verdict |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for variant, c in checks.items():
            lo, hi = c["interval"]
            verdict = (
                "inside" if c["measured"] is not None and lo <= c["measured"] <= hi else ("missed")
            )
            measured = "" if c["measured"] is None else f"{c['measured']:.4f}"
            lines.append(f"| {variant} | ({c['n_params']}, {c['tokens']}) | {c['predicted']:.4f}"
                         f" [{lo:.4f}, {hi:.4f}] | {measured} | {verdict} |")  # fmt: skip
    return lines + [""]


def plot_ladder(ladder: dict, results: dict):
    """Left: IsoFLOP curves (loss against N per budget, each variant its marker, the
    parabolas' minima starred). Right: each variant's compute-optimal loss against C with the
    approach-3 curve extended to the target, and the check runs."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    points = ladder_points(ladder, results)
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    budgets = sorted({p[0] for pts in points.values() for p in pts})
    colors = {b: f"C{i}" for i, b in enumerate(budgets)}
    markers = dict(zip(points, "osD^v", strict=False))
    for variant, pts in points.items():
        for budget in budgets:
            sel = sorted((p[1], p[3]) for p in pts if p[0] == budget)
            if sel:
                left.plot(*zip(*sel, strict=True), marker=markers[variant], color=colors[budget],
                          ls="-" if variant == list(points)[0] else "--", ms=4,
                          label=f"{variant} C={budget:.2g}")  # fmt: skip
        for c, n, loss in isoflop_minima(pts):
            left.plot([n], [loss], marker="*", ms=12, color=colors[c], mec="k")
        a = ladder.get("analysis", {}).get(variant)
        if a:
            cs = np.geomspace(min(budgets), ladder["target"], 30)
            fit = a["approach3"]
            right.plot(cs, [optimal(fit, c)[2] for c in cs], label=f"{variant}: approach 3")
            mins = isoflop_minima(pts)
            right.plot([m[0] for m in mins], [m[2] for m in mins], "o", ms=4,
                       label=f"{variant}: IsoFLOP minima")  # fmt: skip
            lo, hi = a["intervals"]["l_opt3"] or (None, None)
            if lo is not None:
                mid = a["predicted"]["l_opt3"]
                right.errorbar([ladder["target"]], [mid], yerr=[[mid - lo], [hi - mid]],
                               fmt="s", capsize=3, ms=4)  # fmt: skip
        check = ladder.get("checks", {}).get(variant)
        if check and check["measured"] is not None:
            right.plot([ladder["target"]], [check["measured"]], "x", ms=10, mew=2,
                       label=f"{variant}: check run")  # fmt: skip
    left.set_xscale("log")
    left.set_xlabel("N (non-embedding parameters)")
    left.set_ylabel("final eval loss")
    left.set_title("IsoFLOP curves", fontsize="medium")
    left.legend(fontsize="xx-small", ncol=2)
    right.set_xscale("log")
    right.xaxis.set_minor_formatter(NullFormatter())  # the minor labels overlap
    right.set_xlabel("compute C = 6ND (FLOPs)")
    right.set_ylabel("compute-optimal loss")
    right.set_title("scaling and its check", fontsize="medium")
    right.legend(fontsize="xx-small")
    return fig
