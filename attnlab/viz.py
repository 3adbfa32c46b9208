"""Plots: attention weights as heat maps, loss curves of training runs.

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot state), so they work
under any backend, including Agg in tests; a notebook displays the returned figure.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
from matplotlib.figure import Figure


def plot_attention(
    weights_NTS,
    tokens=None,
    *,
    query_tokens=None,
    heads=None,
    ncols: int = 4,
    cmap: str = "viridis",
    title: str | None = None,
    cell_size: float = 0.25,
) -> Figure:
    """Heat maps of attention weights, one panel per head.

    Args:
      weights_NTS: weights ``[N, T, S]`` (one batch row of ``Pretrained.attention``) or a
        single map ``[T, S]``; rows are queries, columns keys.
      tokens: labels of the S keys (strings or ids); also used for the queries when
        ``query_tokens`` is None and T == S.
      query_tokens: labels of the T queries (cross-attention).
      heads: which heads to draw (default all).
      ncols: panels per row.
    """
    w = np.asarray(weights_NTS, dtype=np.float32)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"expected weights [N, T, S] or [T, S], got shape {w.shape}")
    N, T, S = w.shape
    heads = list(range(N)) if heads is None else list(heads)
    if not heads or any(not 0 <= h < N for h in heads):
        raise ValueError(f"heads={heads} must be a non-empty list of indices in [0, {N})")
    keys = None if tokens is None else [str(t) for t in tokens]
    if keys is not None and len(keys) != S:
        raise ValueError(f"{len(keys)} key labels for S={S} keys")
    queries = query_tokens if query_tokens is not None else (tokens if T == S else None)
    queries = None if queries is None else [str(t) for t in queries]
    if queries is not None and len(queries) != T:
        raise ValueError(f"{len(queries)} query labels for T={T} queries")

    cols = min(ncols, len(heads))
    rows = math.ceil(len(heads) / cols)
    panel = (max(2.5, cell_size * S + 1.0), max(2.5, cell_size * T + 1.0))
    fig = Figure(figsize=(panel[0] * cols, panel[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    for ax, h in zip(axes.flat, heads, strict=False):
        image = ax.imshow(w[h], cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if keys is not None:
            ax.set_xticks(range(S), keys, rotation=90, fontsize=7)
        if queries is not None:
            ax.set_yticks(range(T), queries, fontsize=7)
    for ax in list(axes.flat)[len(heads) :]:
        ax.set_axis_off()
    fig.colorbar(image, ax=axes, shrink=0.8, label="weight")
    if title:
        fig.suptitle(title)
    return fig


def read_metrics(workdir) -> list[dict]:
    """The records of ``workdir/metrics.jsonl`` (one dict per logged step)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {workdir} an attnlab work directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss_curves(workdirs, *, labels=None, title="loss", log_y=False) -> Figure:
    """Train (solid) and eval (dashed, markers) loss against step for one or more runs."""
    workdirs = [workdirs] if isinstance(workdirs, str | pathlib.Path) else list(workdirs)
    labels = labels or [pathlib.Path(w).name or str(w) for w in workdirs]
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for i, (workdir, label) in enumerate(zip(workdirs, labels, strict=True)):
        records = read_metrics(workdir)
        color = f"C{i % 10}"
        train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if train:
            ax.plot(*zip(*train, strict=True), color=color, label=f"{label} train")
        if evals:
            ax.plot(
                *zip(*evals, strict=True),
                color=color,
                ls="--",
                marker="o",
                ms=3,
                label=f"{label} eval",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def save_loss_curves(workdirs, out, **kw) -> pathlib.Path:
    """Writes ``plot_loss_curves`` to a PNG and returns its path."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_loss_curves(workdirs, **kw).savefig(out, dpi=120)
    return out
