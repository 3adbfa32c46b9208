"""What the run-time input checks cost: per training step and per decoding step, on and off.

Training (``train``): ``Trainer.train_step`` checks each batch's token ids on the host before
the step (``attnlab.train.objectives.check_batch_ids``: a target past the vocabulary would
make the loss NaN). ``off`` runs the same compiled program without the check
(``Trainer.flat_train_step``, what the training loop calls on batches the data pipeline has
checked already); ``on`` also flattens and rebuilds the nested state around the program, as
``train_step`` does, so ``check_us`` (the check alone) and ``check_share_of_step`` are the
check's own cost.

Decoding (``decode``): a hand-written loop of one token per call under ``nnx.jit``, with a
linear cache. ``plain`` is the loop as shipped: a plain jit traces none of the model's checks
of traced values (``attnlab.errors.traced_check``), so its program is the unchecked one.
``checked`` is the loop through ``attnlab.decode.checks.checked_jit`` (checkify: a write past
the capacity or a position past the table raises), which reads the error flag back after
every call; ``plain_synced`` is ``plain`` reading its logits back after every call too, as a
loop that samples on the host does: the fair baseline for ``checked``.

Each variant is compiled first; then ``--repeats`` rounds time every variant in turn (the
variants interleaved, so a change in a shared machine's load reaches them all alike), and
the figures are the medians over rounds, with the ratios on/off of the same run.

Prints one JSON object (the config, the machine, the timings); ``--out FILE`` writes it too.

    python benchmarks/runtime_checks.py [--repeats 7] [--steps 10] [--tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import machine  # benchmarks/machine.py: the machine, measured in this run
import numpy as np
from flax import nnx

from attnlab import experiment, init_cache
from attnlab.decode.checks import checked_jit
from attnlab.nn import build_model
from attnlab.train import Trainer
from attnlab.train.objectives import check_batch_ids

REPO = pathlib.Path(__file__).resolve().parents[1]


def char_lm(tiny: bool):
    path = f"{REPO / 'experiments' / 'char_lm.py'}"
    return experiment.load_config(path + (":tiny" if tiny else ""))


class Training:
    """The train step of ``cfg`` with the host check (``on``) and without (``off``)."""

    def __init__(self, cfg):
        self.trainer = Trainer(cfg, kind="lm")
        B, T, V = int(cfg.train.batch_size), int(cfg.data.seq_len), int(cfg.model.vocab_size)
        rng = np.random.default_rng(0)
        self.batch = {
            "inputs": rng.integers(0, V, (B, T), dtype=np.int32),
            "targets": rng.integers(0, V, (B, T), dtype=np.int32),
            "loss_mask": np.ones((B, T), np.float32),
        }
        self.state = self.trainer.init_state()
        self.leaves, self.treedef = jax.tree.flatten(self.state)
        self.state = None
        self.flat = self.trainer.flat_train_step(self.treedef)
        self.off(1)  # compiles

    def on(self, steps: int) -> float:
        """Seconds per step through ``train_step`` (the check, then the program)."""
        state = jax.tree.unflatten(self.treedef, self.leaves)
        start = time.perf_counter()
        for _ in range(steps):
            state, out = self.trainer.train_step(state, self.batch)
        jax.block_until_ready(out["loss"])
        took = time.perf_counter() - start
        self.leaves = jax.tree.leaves(state)
        return took / steps

    def off(self, steps: int) -> float:
        """Seconds per step of the same program without the check."""
        leaves = self.leaves
        start = time.perf_counter()
        for _ in range(steps):
            leaves, out = self.flat(leaves, self.batch)
        jax.block_until_ready(out["loss"])
        took = time.perf_counter() - start
        self.leaves = leaves
        return took / steps

    def check_alone(self, calls: int = 200) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            check_batch_ids(self.batch, "lm", self.trainer.mcfg.vocab_size)
        return (time.perf_counter() - start) / calls


def _body(model, ids, cache):
    out = model(ids, cache=cache)
    return out.logits, out.cache


class Decoding:
    """One token per call of a hand-written ``nnx.jit`` loop, four ways (module docstring)."""

    def __init__(self, cfg, tokens: int):
        mcfg = experiment.validate(cfg)
        self.model = build_model(mcfg, seed=0)
        self.capacity = tokens + 1
        self.tokens = tokens
        self.ids = jnp.asarray([[1]], jnp.int32)
        self.steps = {"plain": nnx.jit(_body), "checked": checked_jit(_body, jit=nnx.jit)}
        for name in ("plain", "checked"):
            self._loop(name, 2)  # compiles

    def _loop(self, name: str, n: int, synced: bool = False) -> float:
        step = self.steps[name]
        cache = init_cache(self.model.cfg, 1, self.capacity)
        logits, cache = step(self.model, self.ids, cache)  # the first token: not timed
        jax.block_until_ready(logits)
        start = time.perf_counter()
        for _ in range(n):
            logits, cache = step(self.model, self.ids, cache)
            if synced:
                np.asarray(logits)
        jax.block_until_ready(logits)
        return (time.perf_counter() - start) / n

    def time(self, variant: str) -> float:
        if variant == "plain_synced":
            return self._loop("plain", self.tokens, synced=True)
        return self._loop(variant, self.tokens)


def _summary(samples: dict, base: dict) -> dict:
    """Median ms per step of each variant, its ratio to its baseline (of the medians), and
    the median of the ratios of each round (the two measured back to back in it: the figure
    a shared machine's changing load moves least)."""
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    out = {}
    for k, v in med.items():
        out[k] = dict(median_ms=round(v, 4), runs_ms=[round(x * 1e3, 4) for x in samples[k]])
        if k in base:
            b = base[k]
            out[k][f"vs_{b}"] = round(v / med[b], 4)
            pairs = [x / y for x, y in zip(samples[k], samples[b], strict=True)]
            out[k][f"vs_{b}_paired_median"] = round(statistics.median(pairs), 4)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="train steps per timed round")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per timed round")
    p.add_argument("--quick", action="store_true", help="the tiny config, 3 repeats")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.steps, a.tokens = 3, 3, 16
    cfg = char_lm(tiny=a.quick)
    about = machine.describe()
    train = Training(cfg)
    decode = Decoding(cfg, a.tokens)
    t = {"off": [], "on": []}
    d = {"plain": [], "plain_synced": [], "checked": []}
    for i in range(a.repeats):  # every variant once per round, in turn (order alternating)
        for k in ("off", "on") if i % 2 == 0 else ("on", "off"):
            t[k].append(train.off(a.steps) if k == "off" else train.on(a.steps))
        for name in list(d) if i % 2 == 0 else list(d)[::-1]:
            d[name].append(decode.time(name))
    out = dict(
        benchmark="runtime_checks",
        config=dict(
            experiment="char_lm" + (":tiny" if a.quick else ""),
            model={k: cfg.model[k] for k in ("d_model", "n_layers", "n_heads", "vocab_size")},
            batch=int(cfg.train.batch_size),
            seq_len=int(cfg.data.seq_len),
            decode=dict(batch=1, cache_max_len=a.tokens + 1, tokens=a.tokens, jit="nnx.jit"),
            repeats=a.repeats,
            steps_per_round=a.steps,
        ),
        machine=about,
        train=dict(
            _summary(t, {"on": "off"}),
            check_us=round(train.check_alone() * 1e6, 2),
        ),
        decode=_summary(d, {"checked": "plain_synced", "plain_synced": "plain"}),
    )
    step_us = out["train"]["off"]["median_ms"] * 1e3
    out["train"]["check_share_of_step"] = round(out["train"]["check_us"] / step_us, 7)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
