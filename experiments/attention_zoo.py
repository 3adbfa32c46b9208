"""Every built-in attention variant, the recurrent layers and their hybrids on multi-query
associative recall and length extrapolation.

MQAR (``data.kind="mqar"``, Zoology, Arora et al. 2023): each row lists key/value pairs, then
asks for every key again, in a random order and at random places; only the recalled values
count. A decoder with RoPE (which extends past its training length) learns it at T tokens.
``sweep()`` trains each row of the zoo (``zoo_rows()``: every registered mixer defined in the
package, ``mha`` first, then the ``HYBRIDS``) over training sets x seeds (``SWEEPS``).

The rows. ``gated_deltanet`` and ``mamba2`` are the recurrent layers (a fixed-size state, no
positions: they run at any length; Mamba-2 keeps a state of 16, ``SETTINGS``); ``dsa`` keeps
16 keys per query, so it is sparse at T = 64. Zoology uses
2 layers, which cannot hold a 3:1 hybrid, so there are two: ``hybrid_3to1`` has 4 layers
(three Gated DeltaNet, then attention) at the parameters of the 2-layer ``mha``, hence a
narrower ``d_model``; ``hybrid_1to1`` keeps 2 layers (Gated DeltaNet, then attention).
Rows are compared at a matched parameter count: each gets the ``d_model`` (a multiple of
twice its heads) whose ``attnlab.count_params`` is closest to that of ``mha`` at the
config's size, then the FFN width that brings it within one FFN column of it
(``matched_sizes``; ``--sizes`` prints them, with the ratio to ``mha``)::

    attnlab sweep --config experiments/attention_zoo.py --workdir runs/zoo
    attnlab sweep --config experiments/attention_zoo.py:small --workdir runs/zoo_small
    attnlab sweep --config experiments/attention_zoo.py:zoology --workdir runs/zoology
    attnlab sweep --config experiments/attention_zoo.py:zoology_long --workdir runs/zoology_long
    attnlab sweep --config experiments/attention_zoo.py:catalogue --workdir runs/zoo_catalogue
    python experiments/attention_zoo.py --report runs/zoo     # extrapolation, table, plots
    python experiments/attention_zoo.py --sizes [--variant zoology]

A training set is ``(T, min pairs, max pairs)``: each row draws its count of pairs uniformly
(``:zoology`` trains on 4 to 16 pairs at T = 64). ``--report`` scores every finished trial
on 256 fresh rows (a stream no training step draws) at each pair count of its range
(``eval_pairs``: both ends and the powers of two between) and at T, 2T, 4T and 8T with
those pairs, so the queries lie further from their keys (teacher-forced: a value counts when
it is the argmax); each trial keeps its scores in ``TRIAL/extrapolation.json``. It writes
``DIR/zoo.md`` and ``DIR/zoo.json`` (mean ± sample std over seeds, per row, pairs and length),
``DIR/extrapolation_<row>.png`` and ``DIR/recall_by_pairs.png`` (Zoology's figure 2 in shape:
accuracy at T against pairs, a line per row). Positions that cannot extend (``learned``,
``sinusoidal`` past ``max_len``) get no extrapolation columns.

Measured with ``:small`` (4 pairs, T = 64, 600 steps, 3 seeds, 2 shared CPU cores; MQAR
recall, mean ± std over seeds; before the FFN widths were matched, so ``mla`` has 13% more
parameters)::

    variant        params    at T            at 2T           at 4T           at 8T
    differential   103,072   0.541 ± 0.002   0.549 ± 0.002   0.422 ± 0.047   0.217 ± 0.046
    gated          103,488   0.398 ± 0.049   0.377 ± 0.024   0.305 ± 0.019   0.240 ± 0.020
    mha            102,976   0.329 ± 0.040   0.308 ± 0.035   0.250 ± 0.019   0.209 ± 0.022
    mla            116,416   0.304 ± 0.057   0.308 ± 0.068   0.296 ± 0.036   0.235 ± 0.027
    sinks          102,984   0.310 ± 0.043   0.291 ± 0.029   0.253 ± 0.036   0.214 ± 0.014

600 steps is short of solving MQAR for any of them.

Measured with ``:zoology`` (T = 64, 4 to 16 pairs per row, 1,200 steps of 64 rows, 3 seeds,
2 CPU cores; recall at T, mean ± std over seeds, on 256 fresh rows with the pairs given;
docs/experiments.md has 2T to 8T and the recipe's story)::

    row            params   4 pairs         8 pairs         16 pairs
    mha            107,328  0.889 ± 0.192   0.830 ± 0.294   0.784 ± 0.373
    gated_deltanet 107,376  1.000 ± 0.001   0.995 ± 0.004   0.931 ± 0.034
    mamba2         107,272  0.980 ± 0.008   0.939 ± 0.025   0.726 ± 0.095
    hybrid_3to1    107,436  0.800 ± 0.218   0.661 ± 0.306   0.449 ± 0.311
    hybrid_1to1    107,352  1.000 ± 0.000   1.000 ± 0.000   0.999 ± 0.002

Two of mha's seeds recall 1.000 / 1.000 / 0.999; the third left the copy-a-value plateau
near step 1,100. The fixed-state rows fall off as pairs grow (Mamba-2 with a state of 16
most); the 4-layer 3:1 hybrid trains slowest (one seed 0.996 / 0.977 / 0.805).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import typing

from attnlab.evaluation import mqar
from attnlab.evaluation.mqar import EVAL_STREAM, eval_pairs, mqar_accuracy, predictor  # noqa: F401
from attnlab.experiment import (
    ExperimentError,
    base_config,
    flat_keys,
    matched,
    run_script,
    tiny_run,
)

VARIANTS = ("small", "tiny", "zoology", "zoology_long", "catalogue")
FACTORS = (1, 2, 4, 8)  # evaluation lengths, in multiples of the training length
EXTENDS = ("rope", "alibi", "none")  # positions that reach past the training length
# Settings of the recurrent rows (a layer kind with its own settings is a block of
# ``ModelConfig.block_pattern``; a block of one kind is a plain stack): Mamba-2 keeps a state
# of 16 per channel, as Zoology's Mamba-2 rows (8 to 24), not its default 128. The sparse
# rows' paper settings (MoBA blocks of 512; NSA 32/16/64 with a 512 window; DSA's 2048 keys)
# cover the zoo's T whole, so they shrink to keep each query on a part of its keys at T = 64.
SETTINGS = {
    "mamba2": {"state_size": 16},
    "dsa": {"topk": 16},
    "moba": {"block_size": 8, "topk": 3},
    "nsa": {
        "compress_block": 8, "compress_stride": 4, "select_block": 8, "top_n": 4,
        "local_blocks": 2, "window": 16,
    },
}  # fmt: skip
# no positions: they extend to any length
RECURRENT_MIXERS = ("gated_deltanet", "kda", "lightning", "mamba", "mamba2", "short_conv")


def _kind(mixer: str):
    return {"mixer": mixer, "mixer_settings": SETTINGS[mixer]} if mixer in SETTINGS else mixer


# Hybrid stacks. Zoology's 2 layers cannot hold 3:1, so the 3:1 hybrid has 4 layers (three
# Gated DeltaNet, then attention) at the 2-layer mha's parameters; the 1:1 hybrid keeps
# Zoology's 2 layers (Gated DeltaNet, then attention).
HYBRIDS = {
    "hybrid_3to1": {
        "n_layers": 4,
        "block_pattern": {"block": (_kind("gated_deltanet"),) * 3 + ("mha",)},
    },
    "hybrid_1to1": {"n_layers": 2, "block_pattern": {"block": (_kind("gated_deltanet"), "mha")}},
}


class Grid(typing.NamedTuple):
    """A sweep's training sets, as ``(seq_len, min pairs, max pairs)`` (each row draws its
    count of pairs uniformly), its seeds, and its rows (None: every row)."""

    points: tuple[tuple[int, int, int], ...]
    seeds: tuple[int, ...]
    rows: tuple[str, ...] | None = None


RECURRENT = ("mha", "gated_deltanet", "mamba2", "hybrid_3to1", "hybrid_1to1")
CATALOGUE = ("mha", "short_conv", "mamba", "fox", "dsa", "moba", "nsa", "lightning", "kda")
SWEEPS = {
    None: Grid(((64, 4, 4), (64, 8, 8), (128, 4, 4), (128, 8, 8)), (0, 1, 2)),
    "small": Grid(((64, 4, 4),), (0, 1, 2)),  # one point of the full grid, 600 steps
    "tiny": Grid(((16, 2, 2),), (0, 1)),
    # Zoology's figure 2 in shape: 2 layers at d_model 64, mha against the fixed-state rows,
    # trained on 4 to T/4 pairs per row and scored at 4, 8 and 16. T = 128 and 256 (add
    # (128, 4, 32), (256, 4, 64) with data.num_symbols=128) did not fit the CPU time.
    "zoology": Grid(((64, 4, 16),), (0, 1, 2), RECURRENT),
    # Zoology's longest point: T = 256, 4 to 64 pairs (128 symbols), attention against the
    # two recurrent layers, 2 seeds (what the CPU time allowed).
    "zoology_long": Grid(((256, 4, 64),), (0, 1), ("mha", "gated_deltanet", "mamba2")),
    # The 2025-26 mixers at ``:zoology``'s point, beside mha, one seed (the CPU time).
    "catalogue": Grid(((64, 4, 16),), (0,), CATALOGUE),
}


def get_config(variant=None):
    c = base_config()
    c.name = "attention_zoo"
    grid = SWEEPS[variant]
    T, lo, hi = grid.points[0]
    c.model.update(
        arch="decoder",
        vocab_size=4 + 64,  # synthetic.symbols_vocab_size(64)
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_len=max(FACTORS) * max(p[0] for p in grid.points),
        position="rope",
        norm="rmsnorm",
        mixer="mha",
    )
    c.data.update(kind="mqar", seq_len=T, num_symbols=64, min_len=lo)
    c.data.max_len = hi
    c.optim.update(learning_rate=3e-3, warmup_steps=100, weight_decay=0.01)
    c.train.update(steps=2000, batch_size=64, log_every_steps=100)
    c.eval.update(every_steps=500, batches=4, batch_size=64, sample_tokens=0)
    c.checkpoint.update(every_steps=1000, max_to_keep=1)
    if variant == "small":
        c.train.update(steps=600, batch_size=32)
        c.eval.update(every_steps=300, batch_size=32)
        c.checkpoint.update(every_steps=600)
    if variant in ("zoology", "zoology_long", "catalogue"):
        # What lets attention leave the copy-a-value plateau within the CPU's budget: untied
        # embeddings read at unit scale (init_std d_model^-1/2, times sqrt(d_model)), Adam at
        # a constant 1e-3 after 50 warm-up steps, no weight decay.
        c.model.update(tie_embeddings=False, embed_scale=True, init_std=64**-0.5)
        c.optim.update(learning_rate=1e-3, warmup_steps=50, schedule="constant", weight_decay=0.0)
        c.train.update(steps=1200, batch_size=64)
        c.eval.update(every_steps=400, batch_size=64)
        c.checkpoint.update(every_steps=1200)
    if variant == "zoology_long":  # 16 rows of 256 tokens: the same tokens a step
        c.model.update(vocab_size=4 + 128)
        c.data.update(num_symbols=128)
        c.train.update(steps=1600, batch_size=16)
        c.eval.update(every_steps=400, batch_size=16)
        c.checkpoint.update(every_steps=1600)
    if variant == "tiny":
        c.model.update(vocab_size=4 + 8, d_model=16, n_layers=1, n_heads=2)
        c.data.update(num_symbols=8)
        c.optim.update(warmup_steps=1)
        tiny_run(c, steps=2)
    return c


def builtin_mixers() -> list[str]:
    """The registered variants that ship with attnlab (``mha`` first)."""
    import attnlab

    names = [
        n for n, c in attnlab.registered_mixers().items() if c.__module__.startswith("attnlab.")
    ]
    return sorted(names, key=lambda n: (n != "mha", n))


def zoo_rows() -> dict[str, dict]:
    """The zoo's rows: ``{name: model fields}``, every built-in mixer (``mha`` first), then
    ``HYBRIDS``."""
    plain = {n: {"mixer": n} for n in builtin_mixers()}
    for n in SETTINGS:
        plain[n]["block_pattern"] = {"block": (_kind(n),)}
    return {**plain, **HYBRIDS}


def row_of(model: dict) -> str:
    """The name of the row whose fields ``model`` (a saved config's ``model``) holds."""
    patterned = bool((model.get("block_pattern") or {}).get("block"))
    for name, fields in zoo_rows().items():
        if ("block_pattern" in fields) == patterned and _holds(model, fields):
            return name
    return model["mixer"]


def _holds(have, want) -> bool:
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_holds(have.get(k), v) for k, v in want.items())
    return json.dumps(have, sort_keys=True) == json.dumps(want, sort_keys=True)


def matched_sizes(model, names=None) -> dict:
    """``attnlab.experiment.matched.matched_sizes`` of the zoo's rows (``zoo_rows()``, or a
    registered mixer's name): each one's ``d_model``, ``d_ff``, parameters and ratio to
    ``mha``'s."""
    return matched.matched_sizes(model, zoo_rows(), names)


def sweep(variant=None):
    """Each row at its matched size x training set x seeds (``SWEEPS[variant]``)."""
    from attnlab.sweep import grid, product

    spec = SWEEPS[variant]
    sizes = matched_sizes(get_config(variant).model, spec.rows)
    broken = {n: s["error"] for n, s in sizes.items() if "error" in s}
    if broken:
        raise ExperimentError(f"attention_zoo: these rows do not build: {broken}")
    size = lambda s: {"model.d_model": s["d_model"], "model.d_ff": s["d_ff"]}
    per_row = [{**flat_keys(zoo_rows()[n], "model."), **size(s)} for n, s in sizes.items()]
    per_set = [  # model.max_len covers 8x the longest
        {"data.seq_len": t, "data.min_len": lo, "data.max_len": hi} for t, lo, hi in spec.points
    ]
    # Seeds outermost: every row has its first seed before any has its last.
    return product(grid({"train.seed": list(spec.seeds)}), per_row, per_set)


def extrapolation(workdir, *, factors=FACTORS, rows: int = 256) -> dict:
    """``attnlab.evaluation.mqar.extrapolation`` of the run in ``workdir``: each pair count
    at each factor of its training length (only 1 for positions that do not extend)."""
    return mqar.extrapolation(workdir, factors=factors, rows=rows, extends=_extends)


def _extends(mcfg) -> bool:
    """Whether the model reaches past its training length: its positions extend, or no layer
    reads positions at all (a recurrent stack)."""
    from attnlab.config.layer_kinds import stack_plan

    if mcfg.position in EXTENDS:
        return True
    specs = stack_plan(mcfg, mcfg.n_layers).mixer_specs
    return all(s.mixer in RECURRENT_MIXERS for s in specs)


def _mean_std(xs):
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def report(sweep_dir, *, rows: int = 256, plot: bool = True) -> dict:
    """Scores every finished trial of the sweep in ``sweep_dir`` at each pair count and length,
    then writes ``zoo.json``, ``zoo.md``, one ``extrapolation_<row>.png`` per row and
    ``recall_by_pairs.png`` (Zoology's figure 2 in shape)."""
    from attnlab import sweep as sweeps

    root = pathlib.Path(sweep_dir)
    results = sweeps.collect(root)
    groups: dict[tuple, list] = {}
    for row in results["trials"]:
        if row["status"] != "finished":
            continue
        config = json.loads((root / row["trial"] / "config.json").read_text())
        d = config["data"]
        key = (row_of(config["model"]), d["min_len"], d["max_len"], d["seq_len"])
        scores = extrapolation(root / row["trial"], rows=rows)
        params = matched.param_count(json.dumps(config["model"], sort_keys=True))
        groups.setdefault(key, []).append((params, scores))
    table = []
    for (name, lo, hi, T), members in sorted(groups.items()):
        first = members[0][1]
        for i, p in enumerate(first["pairs"]):
            entry = {"variant": name, "params": members[0][0], "trained_pairs": [lo, hi]}
            entry.update(pairs=p, seq_len=T, seeds=len(members), lengths=first["lengths"])
            stats = [_mean_std([m[1]["accuracy"][i][j] for m in members])
                     for j in range(len(first["lengths"]))]  # fmt: skip
            entry.update(mean=[m for m, _ in stats], std=[s for _, s in stats])
            table.append(entry)
    (root / "zoo.json").write_text(json.dumps(table, indent=1) + "\n")
    (root / "zoo.md").write_text(markdown(table))
    if plot:
        _plots(table, root)
    return {"table": table, "results": results}


def _plots(table, root):
    from attnlab import viz

    for name in dict.fromkeys(e["variant"] for e in table):
        curves = {
            f"{e['pairs']} pairs, T={e['seq_len']}": (e["lengths"], e["mean"], e["std"])
            for e in table
            if e["variant"] == name
        }
        fig = viz.plot_accuracy_by_length(curves, title=f"MQAR recall: {name}")
        fig.savefig(root / f"extrapolation_{name}.png", dpi=120)
    recall_by_pairs(table).savefig(root / "recall_by_pairs.png", dpi=120)


def recall_by_pairs(table):
    """Zoology's figure 2 in shape: a panel per training length, accuracy at that length
    against the pairs per row, a line (mean ± std over seeds) per row of the zoo."""
    from attnlab import viz

    panels: dict[str, dict] = {}
    for e in sorted(table, key=lambda e: (e["seq_len"], e["pairs"])):
        curve = panels.setdefault(f"T = {e['seq_len']}", {}).setdefault(e["variant"], ([], [], []))
        for values, value in zip(curve, (e["pairs"], e["mean"][0], e["std"][0]), strict=True):
            values.append(value)
    return viz.plot_accuracy_by_pairs(panels, ylabel="MQAR accuracy")


def markdown(table) -> str:
    """The results as a markdown table: accuracy mean ± std over seeds at T, 2T, 4T, 8T."""
    head = "| variant | params | trained on | pairs | T | seeds | " + " | ".join(
        f"acc at {f}T" if f > 1 else "acc at T" for f in FACTORS
    )
    lines = [head + " |", "|" + "---|" * (6 + len(FACTORS))]
    for e in table:
        by_length = dict(zip(e["lengths"], zip(e["mean"], e["std"], strict=True), strict=True))
        cells = []
        for f in FACTORS:
            mean, std = by_length.get(e["seq_len"] * f, (None, None))
            cells.append("n/a" if mean is None else f"{mean:.3f} ± {std:.3f}")
        lo, hi = e["trained_pairs"]
        trained = f"{lo}" if lo == hi else f"{lo}-{hi}"
        row = [e["variant"], f"{e['params']:,}", trained, e["pairs"], e["seq_len"], e["seeds"]]
        lines.append("| " + " | ".join(map(str, row + cells)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", metavar="DIR", help="score, tabulate and plot the sweep in DIR")
    p.add_argument("--sizes", action="store_true", help="print each variant's matched size")
    p.add_argument("--variant", choices=VARIANTS, help="for --sizes")
    p.add_argument("--rows", type=int, default=256)
    args = p.parse_args(argv)
    if args.sizes:
        rows = SWEEPS[args.variant].rows
        print(json.dumps(matched_sizes(get_config(args.variant).model, rows)))
    elif args.report:
        print(markdown(report(args.report, rows=args.rows)["table"]), end="")
    else:
        p.error("pass --report DIR or --sizes")


if __name__ == "__main__":
    run_script(main, __file__)
