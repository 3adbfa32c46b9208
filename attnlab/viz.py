"""Plots: attention weights and masks as heat maps, position tables, per-head scores, loss
curves of training runs, accuracy against distance, against length and against key-value
pairs; and the small readers and scores behind them.

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot state), so they work
under any backend, including Agg in tests; a notebook displays the returned figure.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


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


def distinct_colors(n: int) -> list:
    """``n`` colours, none repeated: tab10, tab20, then evenly spaced along ``turbo``."""
    from matplotlib import colormaps

    if n <= 10:
        return [f"C{i}" for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["turbo"](i / (n - 1)) for i in range(n)]


def plot_loss_curves(workdirs, *, labels=None, title="loss", log_y=False) -> Figure:
    """Train (solid) and eval (dashed, markers) loss against step for one or more runs."""
    workdirs = [workdirs] if isinstance(workdirs, str | pathlib.Path) else list(workdirs)
    labels = labels or [pathlib.Path(w).name or str(w) for w in workdirs]
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    colors = distinct_colors(len(workdirs))
    for i, (workdir, label) in enumerate(zip(workdirs, labels, strict=True)):
        records = read_metrics(workdir)
        color = colors[i]
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
    ax.ticklabel_format(axis="y", useOffset=False)
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


# Masks, position tables and head scores -------------------------------------------------------
def _as_2d(x, what: str) -> np.ndarray:
    """``x`` as a 2-D array, dropping leading axes of size 1 (``[1, 1, T, S]`` -> ``[T, S]``)."""
    a = np.asarray(x)
    while a.ndim > 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2:
        raise ValueError(
            f"{what} must be [T, S] (leading axes of size 1 are dropped), got shape "
            f"{np.shape(x)}; pick one batch row / head first, e.g. mask[0, 0]"
        )
    return a


def _cell_grid(ax, rows: int, cols: int, max_cells: int = 48):
    """Thin lines between cells, so single allowed positions stay visible."""
    if rows > max_cells or cols > max_cells:
        return
    ax.set_xticks(np.arange(-0.5, cols, 1.0), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1.0), minor=True)
    ax.grid(which="minor", color="0.85", linewidth=0.5)
    ax.tick_params(which="minor", length=0)


def plot_mask(
    mask_TS,
    *,
    ax=None,
    title: str | None = None,
    query_labels=None,
    key_labels=None,
    cmap: str = "Blues",
) -> Figure:
    """A boolean attention mask as a heat map: filled = may attend (rows queries, columns keys).

    ``mask_TS`` is ``[T, S]`` or any ``attnlab.ops.masks`` output whose leading axes are 1
    (``[1, 1, T, S]``). With ``ax`` the map is drawn there (for grids of masks) and that
    axes' figure is returned.
    """
    m = _as_2d(mask_TS, "mask").astype(np.float32)
    T, S = m.shape
    if ax is None:
        size = (max(2.5, 0.3 * S + 1.2), max(2.5, 0.3 * T + 1.0))
        fig = Figure(figsize=size, layout="constrained")
        ax = fig.add_subplot()
    ax.imshow(m, cmap=cmap, vmin=0.0, vmax=1.0, aspect="equal", interpolation="nearest")
    _cell_grid(ax, T, S)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if key_labels is not None:
        if len(key_labels) != S:
            raise ValueError(f"{len(key_labels)} key labels for S={S} keys")
        ax.set_xticks(range(S), [str(k) for k in key_labels], rotation=90, fontsize=7)
    if query_labels is not None:
        if len(query_labels) != T:
            raise ValueError(f"{len(query_labels)} query labels for T={T} queries")
        ax.set_yticks(range(T), [str(q) for q in query_labels], fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    return ax.figure


def plot_masks(masks: dict, *, ncols: int = 3, cmap: str = "Blues") -> Figure:
    """Several masks side by side, one titled panel per ``{name: mask}`` entry."""
    if not masks:
        raise ValueError("plot_masks needs at least one {name: mask} entry")
    arrays = {name: _as_2d(m, f"mask {name!r}") for name, m in masks.items()}
    cols = min(ncols, len(arrays))
    rows = math.ceil(len(arrays) / cols)
    T = max(a.shape[0] for a in arrays.values())
    S = max(a.shape[1] for a in arrays.values())
    panel = (max(2.5, 0.25 * S + 1.0), max(2.5, 0.25 * T + 1.0))
    fig = Figure(figsize=(panel[0] * cols, panel[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (name, a) in zip(axes.flat, arrays.items(), strict=False):
        plot_mask(a, ax=ax, title=name, cmap=cmap)
    for ax in list(axes.flat)[len(arrays) :]:
        ax.set_axis_off()
    return fig


def plot_position_table(
    table_PD, *, title: str = "position encodings", cmap: str = "RdBu_r"
) -> Figure:
    """A ``[positions, dims]`` table (e.g. ``attnlab.ops.sinusoidal``) as an image."""
    t = _as_2d(table_PD, "table").astype(np.float32)
    P, D = t.shape
    limit = float(np.abs(t).max()) or 1.0
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(t, cmap=cmap, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    ax.set_xlabel(f"dimension (0..{D - 1})")
    ax.set_ylabel(f"position (0..{P - 1})")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="value")
    return fig


def previous_token_scores(weights, *, offset: int = 1) -> np.ndarray:
    """How much each head attends ``offset`` tokens back: mean weight on the (i, i - offset)
    diagonal over queries ``i >= offset``.

    ``weights`` is ``[..., T, S]`` with query ``i`` and key ``i`` at the same position (self-
    attention over one sequence), e.g. ``[N, T, S]`` or ``[L, N, T, S]``; returns ``[...]``
    (one score per head), in [0, 1] when rows are probability distributions.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim < 2:
        raise ValueError(f"weights must be [..., T, S], got shape {w.shape}")
    T, S = w.shape[-2:]
    if offset < 0 or offset >= T or S < T:
        raise ValueError(
            f"need S >= T > offset >= 0 to read the diagonal i - {offset}, got T={T}, S={S}"
        )
    diag = np.diagonal(w, offset=-offset, axis1=-2, axis2=-1)  # [..., T - offset]
    return diag.mean(axis=-1)


def plot_head_scores(
    scores_LN, *, title: str = "score per head", vmax: float | None = None, cmap: str = "magma"
) -> Figure:
    """A ``[layers, heads]`` table of per-head scores as an annotated heat map."""
    s = np.asarray(scores_LN, dtype=np.float32)
    if s.ndim == 1:
        s = s[None]
    if s.ndim != 2:
        raise ValueError(f"scores must be [layers, heads] or [heads], got shape {s.shape}")
    L, N = s.shape
    fig = Figure(figsize=(max(3.0, 0.7 * N + 1.5), max(2.0, 0.5 * L + 1.2)), layout="constrained")
    ax = fig.add_subplot()
    top = float(s.max()) if vmax is None else vmax
    image = ax.imshow(s, cmap=cmap, vmin=0.0, vmax=top or 1.0, aspect="auto")
    for layer in range(L):
        for head in range(N):
            value = float(s[layer, head])
            color = "black" if value > 0.6 * (top or 1.0) else "white"
            ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(N))
    ax.set_yticks(range(L))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax)
    return fig


def read_samples(workdir) -> list[dict]:
    """The text samples a run logged at evaluation time (``workdir/samples.jsonl``)."""
    workdir = pathlib.Path(workdir)
    if not workdir.is_dir():
        raise FileNotFoundError(f"{workdir} is not a directory: is it an attnlab work directory?")
    path = workdir / "samples.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finish_accuracy(ax, xlabel: str, title: str) -> None:
    """An accuracy plot's axes: ``[0, 1]`` with a margin, the labels, a light grid and the
    legend in the lower left."""
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower left")


def plot_accuracy_by_distance(buckets, *, title: str = "retrieval accuracy") -> Figure:
    """Accuracy against distance: one point per bucket of ``{"lo", "hi", "exact_match",
    "token_accuracy"}`` (distances ``lo..hi``), drawn at the bucket's centre; None (an empty
    bucket) leaves a gap."""
    if not buckets:
        raise ValueError("plot_accuracy_by_distance needs at least one bucket")
    centre = [(b["lo"] + b["hi"]) / 2 for b in buckets]
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for key, label, marker in (
        ("exact_match", "whole key", "o"),
        ("token_accuracy", "per token", "s"),
    ):
        values = [math.nan if b[key] is None else b[key] for b in buckets]
        ax.plot(centre, values, marker=marker, ms=4, label=label)
    ax.set_xlim(buckets[0]["lo"], buckets[-1]["hi"])
    _finish_accuracy(ax, "distance from the hidden key to the query (tokens)", title)
    return fig


def plot_accuracy_by_length(curves, *, trained_at=None, title="accuracy against length") -> Figure:
    """Accuracy against evaluation length (log2 axis): ``curves`` maps a label to ``(lengths,
    mean, std)`` (``std`` None for a single run, drawn as a band otherwise); a dotted line
    marks ``trained_at``, the training length."""
    if not curves:
        raise ValueError("plot_accuracy_by_length needs at least one curve")
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for color, (label, (lengths, mean, std)) in zip(
        distinct_colors(len(curves)), curves.items(), strict=True
    ):
        lengths, mean = np.asarray(lengths, float), np.asarray(mean, float)
        ax.plot(lengths, mean, marker="o", ms=4, color=color, label=label)
        if std is not None:
            std = np.asarray(std, float)
            ax.fill_between(lengths, mean - std, mean + std, color=color, alpha=0.2)
    if trained_at is not None:
        ax.axvline(trained_at, color="0.5", ls=":", label=f"trained at {trained_at}")
    ax.set_xscale("log", base=2)
    _finish_accuracy(ax, "evaluation length (tokens)", title)
    return fig


def plot_accuracy_by_pairs(panels, *, ylabel="accuracy") -> Figure:
    """Accuracy against key-value pairs per row (log2 axis), one panel per entry of ``panels``:
    ``{panel title: {label: (pairs, mean, std)}}`` (``std`` drawn as a band), the same colour
    for a label in every panel (Zoology's figure 2 in shape)."""
    if not panels:
        raise ValueError("plot_accuracy_by_pairs needs at least one panel")
    labels = list(dict.fromkeys(label for curves in panels.values() for label in curves))
    colors = dict(zip(labels, distinct_colors(len(labels)), strict=True))
    fig = Figure(figsize=(4 * len(panels), 3.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, curves) in zip(axes, panels.items(), strict=True):
        for label, (pairs, mean, std) in curves.items():
            x, m, s = (np.asarray(v, float) for v in (pairs, mean, std))
            ax.plot(x, m, marker="o", ms=4, color=colors[label], label=label)
            ax.fill_between(x, m - s, m + s, color=colors[label], alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(title)
        ax.set_xlabel("key-value pairs")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize="small", loc="best")
    return fig
