"""Every built-in attention variant on multi-query associative recall and length extrapolation.

MQAR (``data.kind="mqar"``, Zoology, Arora et al. 2023): each row lists key/value pairs, then
asks for every key again, in a random order and at random places; only the recalled values
count. A decoder with RoPE (which extends past its training length) learns it at T tokens.
``sweep()`` trains each variant that ships with attnlab (``model.mixer``: every registered
mixer defined in the package) over pairs x sequence length x seeds. Variants are compared at
a matched parameter count: each gets the ``d_model`` (a multiple of twice its heads) whose
``attnlab.count_params`` is closest to that of ``mha`` at the config's size
(``matched_sizes``; ``--sizes`` prints them, with the ratio to ``mha``). ::

    attnlab sweep --config experiments/attention_zoo.py --workdir runs/zoo
    attnlab sweep --config experiments/attention_zoo.py:small --workdir runs/zoo_small
    python experiments/attention_zoo.py --report runs/zoo     # extrapolation, table, plots
    python experiments/attention_zoo.py --sizes               # the matched sizes

``--report`` scores every finished trial on 256 fresh rows (a stream no training step draws)
at T, 2T, 4T and 8T with the same number of pairs, so the queries lie further from their
keys (teacher-forced: a value counts when it is the argmax); each trial keeps its scores in
``TRIAL/extrapolation.json``. It writes ``DIR/zoo.md`` and ``DIR/zoo.json`` (mean ± sample
std over seeds, per variant, pairs and length) and ``DIR/extrapolation_<variant>.png``.
Positions that cannot extend (``learned``, ``sinusoidal`` past ``max_len``) get no
extrapolation columns.

Measured with ``:small`` (4 pairs, T = 64, 600 steps, 3 seeds, 2 shared CPU cores; MQAR
recall, mean ± std over seeds)::

    variant        params    at T            at 2T           at 4T           at 8T
    differential   103,072   0.541 ± 0.002   0.549 ± 0.002   0.422 ± 0.047   0.217 ± 0.046
    gated          103,488   0.398 ± 0.049   0.377 ± 0.024   0.305 ± 0.019   0.240 ± 0.020
    mha            102,976   0.329 ± 0.040   0.308 ± 0.035   0.250 ± 0.019   0.209 ± 0.022
    mla            116,416   0.304 ± 0.057   0.308 ± 0.068   0.296 ± 0.036   0.235 ± 0.027
    sinks          102,984   0.310 ± 0.043   0.291 ± 0.029   0.253 ± 0.036   0.214 ± 0.014

600 steps is short of solving MQAR for any of them; the full grid trains 2,000.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import statistics

from attnlab.experiment import ExperimentError, base_config

VARIANTS = ("small", "tiny")
FACTORS = (1, 2, 4, 8)  # evaluation lengths, in multiples of the training length
EXTENDS = ("rope", "alibi", "none")  # positions that reach past the training length
EVAL_STREAM = 2  # batch_rng stream of the extrapolation rows (training draws stream 0)
SWEEPS = {  # pairs, sequence lengths, seeds
    None: ([4, 8], [64, 128], [0, 1, 2]),
    "small": ([4], [64], [0, 1, 2]),  # one point of the full grid, 600 steps: minutes on CPU
    "tiny": ([2], [16], [0, 1]),
}


def get_config(variant=None):
    c = base_config()
    c.name = "attention_zoo"
    pairs, lengths, _ = SWEEPS[variant]
    c.model.update(
        arch="decoder",
        vocab_size=4 + 64,  # synthetic.symbols_vocab_size(64)
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_len=max(FACTORS) * max(lengths),
        position="rope",
        norm="rmsnorm",
        mixer="mha",
    )
    c.data.update(kind="mqar", seq_len=lengths[0], num_symbols=64, min_len=pairs[0])
    c.data.max_len = pairs[0]
    c.optim.update(learning_rate=3e-3, warmup_steps=100, weight_decay=0.01)
    c.train.update(steps=2000, batch_size=64, log_every_steps=100)
    c.eval.update(every_steps=500, batches=4, batch_size=64, sample_tokens=0)
    c.checkpoint.update(every_steps=1000, max_to_keep=1)
    if variant == "small":
        c.train.update(steps=600, batch_size=32)
        c.eval.update(every_steps=300, batch_size=32)
        c.checkpoint.update(every_steps=600)
    if variant == "tiny":
        c.model.update(vocab_size=4 + 8, d_model=16, n_layers=1, n_heads=2)
        c.data.update(num_symbols=8)
        c.optim.update(warmup_steps=1)
        c.train.update(steps=2, batch_size=4, log_every_steps=1)
        c.eval.update(every_steps=2, batches=1, batch_size=4)
        c.checkpoint.update(every_steps=2)
    return c


def builtin_mixers() -> list[str]:
    """The registered variants that ship with attnlab (``mha`` first)."""
    import attnlab

    names = [
        n for n, c in attnlab.registered_mixers().items() if c.__module__.startswith("attnlab.")
    ]
    return sorted(names, key=lambda n: (n != "mha", n))


@functools.lru_cache(maxsize=512)
def _count(fields_json: str):
    """``count_params`` of a model config (as JSON), or the one-line reason it is invalid."""
    from attnlab import ModelConfig, count_params
    from attnlab.errors import ConfigError

    try:
        return count_params(ModelConfig.from_dict(json.loads(fields_json)))
    except ConfigError as e:
        return str(e)


def _fields(model, **changes) -> str:
    fields = model.to_dict() if hasattr(model, "to_dict") else dict(model)
    fields.update(changes)
    return json.dumps(fields, sort_keys=True)


def matched_sizes(model, mixers=None) -> dict:
    """``{mixer: {"d_model", "params", "ratio"}}``: for each variant, the ``d_model`` (a
    multiple of ``2 * n_heads``, so RoPE's head dim stays even) whose parameter count is
    closest to ``mha``'s at ``model``'s size; ``{"error": ...}`` when none builds."""
    mixers = builtin_mixers() if mixers is None else list(mixers)
    target = _count(_fields(model, mixer="mha"))
    if isinstance(target, str):
        raise ExperimentError(f"model: {target}")
    step, d = 2 * model["n_heads"], model["d_model"]
    candidates = list(range(step, 4 * d + 1, step))
    out = {}
    for name in mixers:
        count = lambda dm, name=name: _count(_fields(model, mixer=name, d_model=dm))
        lo, hi = 0, len(candidates) - 1  # the first candidate whose count reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            n = count(candidates[mid])
            if isinstance(n, int) and n >= target:
                hi = mid
            else:
                lo = mid + 1
        tried = [candidates[i] for i in (lo - 1, lo) if i >= 0]
        sized = [
            (abs(math.log(n / target)), dm, n) for dm in tried if isinstance(n := count(dm), int)
        ]
        if not sized:
            out[name] = {"error": count(d)}
            continue
        _, dm, n = min(sized)
        out[name] = {"d_model": dm, "params": n, "ratio": round(n / target, 4)}
    return out


def sweep(variant=None):
    """Each built-in variant at its matched size x pairs x sequence length x seeds."""
    from attnlab.sweep import grid, product

    pairs, lengths, seeds = SWEEPS[variant]
    sizes = matched_sizes(get_config(variant).model)
    broken = {n: s["error"] for n, s in sizes.items() if "error" in s}
    if broken:
        raise ExperimentError(f"attention_zoo: these variants do not build: {broken}")
    per_variant = [{"model.mixer": n, "model.d_model": s["d_model"]} for n, s in sizes.items()]
    per_pairs = [{"data.min_len": n, "data.max_len": n} for n in pairs]
    per_length = [{"data.seq_len": t} for t in lengths]  # model.max_len covers 8x the longest
    return product(per_variant, per_pairs, per_length, grid({"train.seed": seeds}))


def mqar_accuracy(run, seq_len: int, *, rows: int = 256, batch_size: int = 64, seed: int = 0):
    """Teacher-forced accuracy of the loaded ``run`` on ``rows`` fresh MQAR rows of ``seq_len``
    tokens with the run's pairs and symbols."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from attnlab.data import batch_rng, synthetic

    d, trainer = run.config.data, run.trainer
    if seq_len > trainer.mcfg.max_len:
        raise ExperimentError(f"seq_len {seq_len} exceeds the run's model.max_len")
    predict = jax.jit(lambda p, x: jnp.argmax(trainer.model(p)(x).logits, -1))
    options = dict(num_symbols=d.num_symbols, min_len=d.min_len, max_len=d.max_len)
    correct = total = 0.0
    for i in range(math.ceil(rows / batch_size)):
        batch = synthetic.mqar_batch(
            batch_rng(seed, i, EVAL_STREAM), batch_size, seq_len, **options
        )
        hit = np.asarray(predict(run.params, batch["inputs"])) == batch["targets"]
        correct += float((hit * batch["loss_mask"]).sum())
        total += float(batch["loss_mask"].sum())
    return correct / total


def extrapolation(workdir, *, factors=FACTORS, rows: int = 256) -> dict:
    """``{"seq_len", "lengths", "accuracy"}`` of the run in ``workdir`` at each factor of its
    training length (only 1 for positions that do not extend); cached in
    ``workdir/extrapolation.json``."""
    from attnlab import runs

    path = pathlib.Path(workdir) / "extrapolation.json"
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("factors") == list(factors) and cached.get("rows") == rows:
            return cached
    run = runs.load_run(workdir)
    if run.config.data.kind != "mqar":
        raise ExperimentError(f"{workdir} holds a data.kind={run.config.data.kind!r} run")
    T = int(run.config.data.seq_len)
    extends = run.trainer.mcfg.position in EXTENDS
    lengths = [T * f for f in factors if (extends or f == 1) and T * f <= run.trainer.mcfg.max_len]
    result = {
        "step": run.step,
        "seq_len": T,
        "factors": list(factors),
        "rows": rows,
        "lengths": lengths,
        "accuracy": [mqar_accuracy(run, t, rows=rows) for t in lengths],
    }
    path.write_text(json.dumps(result) + "\n")
    return result


def _mean_std(xs):
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def report(sweep_dir, *, rows: int = 256, plot: bool = True) -> dict:
    """Scores every finished trial of the sweep in ``sweep_dir`` at each length, then writes
    ``zoo.json``, ``zoo.md`` and one ``extrapolation_<variant>.png`` per variant."""
    from attnlab import sweep as sweeps
    from attnlab import viz

    root = pathlib.Path(sweep_dir)
    results = sweeps.collect(root)
    groups: dict[tuple, list] = {}
    for row in results["trials"]:
        if row["status"] != "finished":
            continue
        o = row["overrides"]
        config = json.loads((root / row["trial"] / "config.json").read_text())
        key = (config["model"]["mixer"], config["data"]["max_len"], config["data"]["seq_len"])
        scores = extrapolation(root / row["trial"], rows=rows)
        params = _count(json.dumps(config["model"], sort_keys=True))
        groups.setdefault(key, []).append((o.get("train.seed"), params, scores))
    table = []
    for (mixer, pairs, T), members in sorted(groups.items()):
        lengths = members[0][2]["lengths"]
        entry = {"mixer": mixer, "pairs": pairs, "seq_len": T, "params": members[0][1]}
        entry.update(seeds=len(members), lengths=lengths, mean=[], std=[])
        for i in range(len(lengths)):
            mean, std = _mean_std([m[2]["accuracy"][i] for m in members])
            entry["mean"].append(mean)
            entry["std"].append(std)
        table.append(entry)
    (root / "zoo.json").write_text(json.dumps(table, indent=1) + "\n")
    (root / "zoo.md").write_text(markdown(table))
    if plot:
        for mixer in dict.fromkeys(e["mixer"] for e in table):
            curves = {
                f"{e['pairs']} pairs, T={e['seq_len']}": (e["lengths"], e["mean"], e["std"])
                for e in table
                if e["mixer"] == mixer
            }
            fig = viz.plot_accuracy_by_length(curves, title=f"MQAR recall: {mixer}")
            fig.savefig(root / f"extrapolation_{mixer}.png", dpi=120)
    return {"table": table, "results": results}


def markdown(table) -> str:
    """The results as a markdown table: accuracy mean ± std over seeds at T, 2T, 4T, 8T."""
    head = "| variant | params | pairs | T | seeds | " + " | ".join(
        f"acc at {f}T" if f > 1 else "acc at T" for f in FACTORS
    )
    lines = [head + " |", "|" + "---|" * (5 + len(FACTORS))]
    for e in table:
        by_length = dict(zip(e["lengths"], zip(e["mean"], e["std"], strict=True), strict=True))
        cells = []
        for f in FACTORS:
            mean, std = by_length.get(e["seq_len"] * f, (None, None))
            cells.append("n/a" if mean is None else f"{mean:.3f} ± {std:.3f}")
        row = [e["mixer"], f"{e['params']:,}", e["pairs"], e["seq_len"], e["seeds"], *cells]
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", metavar="DIR", help="score, tabulate and plot the sweep in DIR")
    p.add_argument("--sizes", action="store_true", help="print each variant's matched size")
    p.add_argument("--variant", choices=VARIANTS, help="for --sizes")
    p.add_argument("--rows", type=int, default=256)
    args = p.parse_args(argv)
    if args.sizes:
        print(json.dumps(matched_sizes(get_config(args.variant).model)))
    elif args.report:
        print(markdown(report(args.report, rows=args.rows)["table"]), end="")
    else:
        p.error("pass --report DIR or --sizes")


if __name__ == "__main__":
    import sys

    from attnlab.errors import AttnlabError

    try:
        main()
    except AttnlabError as e:  # expected errors: the message alone, as the attnlab command
        sys.exit(f"attention_zoo.py: error: {e}")
