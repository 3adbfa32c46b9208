"""MQAR recall of a trained run (``data.kind="mqar"``, Zoology, Arora et al. 2023): scored on
fresh rows (a stream no training step draws) at each pair count of its training range and at
multiples of its training length, teacher-forced (a value counts when it is the argmax).
``experiments/attention_zoo.py`` reports its sweep with it."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable

from attnlab.experiment import ExperimentError

EVAL_STREAM = 2  # batch_rng stream of the extrapolation rows (training draws stream 0)


def eval_pairs(lo: int, hi: int) -> list[int]:
    """The pair counts a trial trained on ``lo..hi`` pairs is scored at: both ends and every
    power of two between."""
    return sorted({lo, hi} | {2**k for k in range(hi.bit_length()) if lo <= 2**k <= hi})


def predictor(run):
    """The jitted ``(params, inputs) -> argmax token`` of the loaded ``run`` (one program per
    length, shared by every pair count)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda p, x: jnp.argmax(run.trainer.model(p)(x).logits, -1))


def mqar_accuracy(
    run, seq_len: int, *, pairs=None, rows: int = 256, batch_size: int = 64, seed: int = 0,
    predict=None,
):  # fmt: skip
    """Teacher-forced accuracy of the loaded ``run`` on ``rows`` fresh MQAR rows of ``seq_len``
    tokens with ``pairs`` pairs each (None: the run's own range) and the run's symbols."""
    import numpy as np

    from attnlab.data import batch_rng, synthetic

    d, trainer = run.config.data, run.trainer
    if seq_len > trainer.mcfg.max_len:
        raise ExperimentError(f"seq_len {seq_len} exceeds the run's model.max_len")
    predict = predict or predictor(run)
    lo, hi = (d.min_len, d.max_len) if pairs is None else (pairs, pairs)
    options = dict(num_symbols=d.num_symbols, min_len=lo, max_len=hi)
    correct = total = 0.0
    for i in range(math.ceil(rows / batch_size)):
        batch = synthetic.mqar_batch(
            batch_rng(seed, i, EVAL_STREAM), batch_size, seq_len, **options
        )
        hit = np.asarray(predict(run.params, batch["inputs"])) == batch["targets"]
        correct += float((hit * batch["loss_mask"]).sum())
        total += float(batch["loss_mask"].sum())
    return correct / total


def extrapolation(
    workdir, *, factors, rows: int = 256, extends: Callable = lambda mcfg: True
) -> dict:
    """``{"seq_len", "pairs", "lengths", "accuracy"}`` of the run in ``workdir``:
    ``accuracy[i][j]`` at ``pairs[i]`` pairs (``eval_pairs`` of its training range) and each
    factor ``lengths[j]`` of its training length (only 1 where ``extends(model config)`` says
    the model does not reach past it); cached in ``workdir/extrapolation.json``."""
    from attnlab import runs

    path = pathlib.Path(workdir) / "extrapolation.json"
    if path.exists():
        cached = json.loads(path.read_text())
        if (cached.get("factors"), cached.get("rows")) == (list(factors), rows) and cached.get(
            "pairs"
        ):  # an older cache without pair counts is scored again
            return cached
    run = runs.load_run(workdir)
    d = run.config.data
    if d.kind != "mqar":
        raise ExperimentError(f"{workdir} holds a data.kind={d.kind!r} run")
    T = int(d.seq_len)
    extends = extends(run.trainer.mcfg)
    lengths = [T * f for f in factors if (extends or f == 1) and T * f <= run.trainer.mcfg.max_len]
    pairs, predict = eval_pairs(int(d.min_len), int(d.max_len)), predictor(run)
    result = {
        "step": run.step,
        "seq_len": T,
        "factors": list(factors),
        "rows": rows,
        "pairs": pairs,
        "lengths": lengths,
        "accuracy": [
            [mqar_accuracy(run, t, pairs=p, rows=rows, predict=predict) for t in lengths]
            for p in pairs
        ],
    }
    path.write_text(json.dumps(result) + "\n")
    return result
