"""What the checkpoint checksums cost: save and restore seconds with and without them, per
checksum, and each checksum's rate over a checkpoint's files and a prepared corpus.

Two training states (parameters and AdamW state, as ``Trainer.init_state`` builds them, the
optimizer moments made random by ``trained_like``): the char_lm tiny twin and char_lm widened
to about 10M parameters. For each checksum (none, and every entry of
``attnlab.data.checksums.CHECKSUMS``) a ``Checkpointer`` saves ``--repeats`` steps, each timed from
the call to the finalised step with its ``checksums.json``, the kinds taking turns within each
repeat; each step is then restored by a fresh ``Checkpointer`` (restoring checks the files
first when the step has checksums). On a shared machine the end-to-end medians move by more
than the checksums cost, so their own share is timed too: checksumming the step's files (best
of ``--repeats``: what ``save`` adds, and what ``restore`` adds) and ``Checkpointer.verify``
(median; the files and orbax's tree metadata, without restoring). The files are in the page
cache throughout (they were just written), as for a run resuming on the machine that saved
it. The corpus: a ``--corpus-mb`` MB token file, each checksum over it, best of ``--repeats``.

Prints JSON (config, machine, timings; medians in seconds) and writes it to ``--out``:

    python benchmarks/checkpoint_checksums.py --out benchmarks/results/checkpoint_checksums.json
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import machine  # benchmarks/machine.py
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from attnlab import experiment  # noqa: E402
from attnlab.data.checksums import CHECKSUMS, file_checksum  # noqa: E402
from attnlab.runs.checkpoint import Checkpointer  # noqa: E402
from attnlab.train import Trainer  # noqa: E402

CHAR_LM = str(REPO / "experiments" / "char_lm.py")
STATES = {
    "char_lm_tiny": (f"{CHAR_LM}:tiny", []),
    "char_lm_10m": (
        CHAR_LM,
        [
            "--config.model.d_model=384",
            "--config.model.n_layers=6",
            "--config.model.n_heads=6",
            "--config.model.d_ff=1024",
        ],
    ),
}


def files_of(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return [
        p for item in ("state", "metadata") for p in (step_dir / item).rglob("*") if p.is_file()
    ]


def trained_like(state: dict) -> dict:
    """``state`` with random optimizer moments: a fresh state's are zeros, which Orbax's
    compression shrinks to nothing, where a trained run's are as incompressible as its
    weights."""
    leaves, tree = jax.tree.flatten(state["opt_state"])
    keys = jax.random.split(jax.random.key(0), len(leaves))
    moments = [
        jnp.abs(jax.random.normal(k, x.shape, x.dtype)) * 1e-3
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim
        else x
        for k, x in zip(keys, leaves, strict=True)
    ]
    return {**state, "opt_state": jax.tree.unflatten(tree, moments)}


def time_state(name: str, repeats: int) -> dict:
    config, overrides = STATES[name]
    cfg = experiment.load_config(config, overrides)
    trainer = Trainer(cfg)
    state = jax.block_until_ready(trained_like(trainer.init_state()))
    abstract = trainer.abstract_state()
    params = sum(x.size for x in jax.tree.leaves(state["params"]))
    out = {
        "config": config,
        "overrides": overrides,
        "params": int(params),
        "state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(state))),
        "checksums": {},
    }
    kinds = [None, *CHECKSUMS]
    names = [k or "none" for k in kinds]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        dirs = {n: pathlib.Path(tmp) / n for n in names}
        ckpts = {
            n: Checkpointer(dirs[n], max_to_keep=repeats + 1, checksum=k)
            for n, k in zip(names, kinds, strict=True)
        }
        for ckpt in ckpts.values():
            ckpt.save(0, state)  # untimed: the first save sets up orbax's machinery
        # Each repeat times every kind in turn, so a change of load on a shared machine
        # falls on all of them alike.
        saves = {n: [] for n in names}
        for step in range(1, repeats + 1):
            for n in names:
                t0 = time.perf_counter()
                ckpts[n].save(step, state)
                saves[n].append(time.perf_counter() - t0)
        for ckpt in ckpts.values():
            ckpt.close()
        restores = {n: [] for n in names}
        verifies = {n: [] for n in names[1:]}  # files and tree metadata, without restoring
        for step in range(1, repeats + 1):
            for n, k in zip(names, kinds, strict=True):
                reader = Checkpointer(dirs[n], checksum=k)
                t0 = time.perf_counter()
                jax.block_until_ready(reader.restore(abstract, step))
                restores[n].append(time.perf_counter() - t0)
                reader.close()
                if k is not None:
                    reader = Checkpointer(dirs[n], checksum=k)
                    t0 = time.perf_counter()
                    reader.verify(step)
                    verifies[n].append(time.perf_counter() - t0)
                    reader.close()
        for n, k in zip(names, kinds, strict=True):
            files = files_of(dirs[n] / "1")
            file_bytes = sum(f.stat().st_size for f in files)
            row = {
                "step_file_bytes": file_bytes,
                "save_sec": round(statistics.median(saves[n]), 4),
                "restore_sec": round(statistics.median(restores[n]), 4),
            }
            if k is not None:  # what save and restore each add: reading and checksumming
                seconds = machine.best_seconds(
                    lambda c=k, fs=files: [file_checksum(f, c) for f in fs], repeats
                )
                row.update(
                    checksum_files_sec=round(seconds, 5),
                    checksum_mb_per_s=round(file_bytes / seconds / 1e6, 1),
                    verify_sec=round(statistics.median(verifies[n]), 5),
                )
            out["checksums"][n] = row
            print(name, n, row, file=sys.stderr, flush=True)
    base = out["checksums"]["none"]
    for checksum in CHECKSUMS:
        row = out["checksums"][checksum]
        row["save_overhead_sec"] = round(row["save_sec"] - base["save_sec"], 4)
        row["restore_overhead_sec"] = round(row["restore_sec"] - base["restore_sec"], 4)
    return out


def time_corpus(mb: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        path = pathlib.Path(tmp) / "tokens.bin"
        rng = np.random.default_rng(0)
        rng.integers(0, 50_000, mb * 10**6 // 2, dtype=np.uint16).tofile(path)
        rows = {}
        for checksum in CHECKSUMS:
            seconds = machine.best_seconds(lambda c=checksum: file_checksum(path, c), repeats)
            rows[checksum] = {"sec": round(seconds, 4), "mb_per_s": round(mb / seconds, 1)}
        return {"file_mb": mb, "checksums": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--states", nargs="+", default=list(STATES), choices=list(STATES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--corpus-mb", type=int, default=50)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    out = {
        "benchmark": "checkpoint_checksums",
        "config": {"states": args.states, "repeats": args.repeats, "corpus_mb": args.corpus_mb},
        "machine": machine.describe(),
        "states": {name: time_state(name, args.repeats) for name in args.states},
        "corpus": time_corpus(args.corpus_mb, args.repeats),
    }
    machine.emit(out, args.out)


if __name__ == "__main__":
    main()
