"""What the run-time input checks cost: per training step and per decoding step, on and off.

Training (``train``): ``Trainer.train_step`` checks each batch's token ids on the host before
the step (``attnlab.train.objectives.check_batch_ids``: a target past the vocabulary would
make the loss NaN). ``off`` runs the same compiled program without the check
(``Trainer.flat_train_step``, what the training loop calls on batches the data pipeline has
checked already); ``on`` also flattens and rebuilds the nested state around the program, as
``train_step`` does, so ``check_us`` (the check alone) and ``check_share_of_step`` are the
check's own cost.

Decoding (``decode``): a hand-written loop of one token per call under ``nnx.jit``, with a
linear cache that never fills. ``plain`` is the loop over a cache built with
``init_cache(..., on_overflow="flag")``: a plain jit traces none of the model's checks of
traced values (``attnlab.errors.traced_check``), so its program is the unchecked one.
``raise`` is the same loop over the default cache (``on_overflow="raise"``): its program
tests the new lengths against the capacity and would call back to the host only past it
(``attnlab.kv_cache.raise_on_overflow``); ``raise`` against ``plain`` is what the default
costs per step. ``jax_flag`` and ``jax_raise`` are the same pair through ``jax.jit`` of a
split model (``nnx.merge`` inside, the cache donated), whose dispatch is cheaper than
``nnx.jit``'s, so the check's share of a step shows more. ``checked`` is the loop through
``attnlab.decode.checks.checked_jit`` (checkify: a write past the capacity or a position past
the table raises), which reads the error flag back after every call; ``plain_synced`` is
``plain`` reading its logits back after every call too, as a loop that samples on the host
does: the fair baseline for ``checked``, and for ``raise_synced`` (``raise`` reading its
logits back). On XLA:CPU a program that holds a host callback runs to its end inside the
call, so ``raise`` gives up the overlap of a step's run with the next call's Python work
(``nnx.jit``'s graph traversal above all), and each run pays for the callback's bookkeeping;
a loop that reads every step's logits has no overlap to give up. Each figure is given in
wall-clock and in this process's CPU time (``cpu``), the steadier one on a shared machine.

Roofline (``decode.roofline``, ``benchmarks/machine.py``, measured in the same run): the
milliseconds a decoding step cannot beat, reading the weights and the row's cache once at
the machine's read rate and doing 2 x params FLOPs at its square matmul rate.

Each variant is compiled first; then ``--repeats`` rounds time every variant in turn (the
variants interleaved, so a change in a shared machine's load reaches them all alike), and
the figures are the medians over rounds, with the ratios on/off of the same run. A decode
round is ``--tokens`` steps; each variant's cache (``--capacity`` slots, default one more
than a round) carries on from its last round while the next fits, so short rounds (finer
interleaving on a loaded machine) still decode against a long cache.

Prints one JSON object (the config, the machine, the timings); ``--out FILE`` writes it too.
``--note`` records the conditions (e.g. that other work shares the machine) in ``machine``.

    python benchmarks/runtime_checks.py [--repeats 7] [--steps 10] [--tokens 64] [--quick]
                                        [--parts train,decode] [--variants plain,raise,...]
                                        [--capacity 128]
                                        [--note TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
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
from attnlab.kv_cache import kv_cache_bytes
from attnlab.nn import build_model, count_params
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
    """One token per call of a hand-written loop, seven ways (module docstring)."""

    # variant -> (step, the cache's on_overflow, logits read back after each call)
    VARIANTS = {
        "plain": ("nnx", "flag", False),
        "raise": ("nnx", "raise", False),
        "jax_flag": ("jax", "flag", False),
        "jax_raise": ("jax", "raise", False),
        "plain_synced": ("nnx", "flag", True),
        "raise_synced": ("nnx", "raise", True),
        "checked": ("checked", "raise", False),
    }

    def __init__(self, cfg, tokens: int, capacity: int | None = None):
        mcfg = experiment.validate(cfg)
        self.model = build_model(mcfg, seed=0)
        self.capacity = capacity or tokens + 1
        self.tokens = tokens
        self.caches = {}  # variant -> its cache, carried from round to round while it fits
        self.ids = jnp.asarray([[1]], jnp.int32)
        graphdef, params = nnx.split(self.model)

        def split_body(params, ids, cache):
            return _body(nnx.merge(graphdef, params), ids, cache)

        def make(kind):
            if kind == "jax":
                jitted = jax.jit(split_body, donate_argnames="cache")
                return lambda ids, cache: jitted(params, ids, cache)
            jitted = nnx.jit(_body) if kind == "nnx" else checked_jit(_body, jit=nnx.jit)
            return lambda ids, cache: jitted(self.model, ids, cache)

        # One jitted function per variant, as a loop has: one shared by two caches would hold
        # two programs and compare a call's arguments with both (nnx's graph equality,
        # ~0.3 ms on this model), which is no cost of either.
        self.steps = {name: make(kind) for name, (kind, _, _) in self.VARIANTS.items()}
        for name in self.VARIANTS:
            self.time(name, 2)  # compiles

    def time(self, variant: str, n: int | None = None) -> tuple[float, float]:
        """Wall-clock and CPU seconds per step of ``n`` (default ``tokens``) steps, after
        the variant's last round; a new cache (its first token not timed) when they would
        not fit the capacity."""
        _, on_overflow, synced = self.VARIANTS[variant]
        step, n = self.steps[variant], n or self.tokens
        cache = self.caches.get(variant)
        if cache is None or int(cache.lengths[0]) + n > self.capacity:
            cache = init_cache(self.model.cfg, 1, self.capacity, on_overflow=on_overflow)
            logits, cache = step(self.ids, cache)
            jax.block_until_ready(logits)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            logits, cache = step(self.ids, cache)
            if synced:
                np.asarray(logits)
        jax.block_until_ready(logits)
        took = (time.perf_counter() - start) / n, (time.process_time() - cpu) / n
        self.caches[variant] = cache
        return took

    def roofline(self, limits: dict) -> dict:
        """The step time the machine allows at this model and cache (module docstring): a
        step over a linear cache reads all its ``capacity`` slots."""
        cfg = self.model.cfg
        params = count_params(cfg)
        tokens_per_s, binding = machine.decode_bound(
            batch=1,
            weight_bytes=params * jnp.dtype(cfg.param_dtype).itemsize,
            cache_bytes_per_row=kv_cache_bytes(cfg, 1, self.capacity, cfg.dtype, ring=False),
            flops_per_token=2 * params,
            bytes_per_s=max(limits["read_gbps"].values()) * 1e9,
            flops_per_s=limits["square_matmul_gflops"] * 1e9,
        )
        return dict(ms_per_step=round(1e3 / tokens_per_s, 5), bound_by=binding,
                    params=params, cache_slots=self.capacity, limits=limits)  # fmt: skip


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


DECODE_BASES = {
    "raise": "plain",
    "jax_raise": "jax_flag",
    "checked": "plain_synced",
    "raise_synced": "plain_synced",
    "plain_synced": "plain",
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="train steps per timed round")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per timed round")
    p.add_argument("--capacity", type=int, default=0, help="decode cache slots (tokens + 1)")
    p.add_argument("--quick", action="store_true", help="the tiny config, 3 repeats")
    p.add_argument("--parts", default="train,decode", help="which of train,decode to time")
    p.add_argument("--variants", default=",".join(Decoding.VARIANTS), help="decode variants")
    p.add_argument("--note", default="", help="the conditions, kept in the JSON's machine")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.steps, a.tokens = 3, 3, 16
    parts = set(a.parts.split(","))
    cfg = char_lm(tiny=a.quick)
    about = machine.describe()
    if a.note:
        about["note"] = a.note
    train = Training(cfg) if "train" in parts else None
    decode = Decoding(cfg, a.tokens, a.capacity) if "decode" in parts else None
    t = {"off": [], "on": []}
    d = {name: [] for name in a.variants.split(",")}
    dc = {name: [] for name in d}
    for i in range(a.repeats):  # every variant once per round, in turn (order alternating)
        for k in (("off", "on") if i % 2 == 0 else ("on", "off")) if train else ():
            t[k].append(train.off(a.steps) if k == "off" else train.on(a.steps))
        for name in (list(d) if i % 2 == 0 else list(d)[::-1]) if decode else ():
            wall, cpu = decode.time(name)
            d[name].append(wall)
            dc[name].append(cpu)
    out = dict(
        benchmark="runtime_checks",
        config=dict(
            experiment="char_lm" + (":tiny" if a.quick else ""),
            model={k: cfg.model[k] for k in ("d_model", "n_layers", "n_heads", "vocab_size")},
            batch=int(cfg.train.batch_size),
            seq_len=int(cfg.data.seq_len),
            decode=dict(batch=1, cache_max_len=a.capacity or a.tokens + 1, tokens=a.tokens,
                        jit="nnx.jit; jax_*: jax.jit of the split model, cache donated"),
            repeats=a.repeats,
            steps_per_round=a.steps,
            parts=sorted(parts),
            variants=list(d),
        ),
        machine=about,
    )  # fmt: skip
    if train:
        check_us = round(train.check_alone() * 1e6, 2)
        out["train"] = dict(_summary(t, {"on": "off"}), check_us=check_us)
        step_us = out["train"]["off"]["median_ms"] * 1e3
        out["train"]["check_share_of_step"] = round(out["train"]["check_us"] / step_us, 7)
    if decode:
        out["decode"] = dict(
            wall=_summary(d, {k: b for k, b in DECODE_BASES.items() if k in d and b in d}),
            cpu=_summary(dc, {k: b for k, b in DECODE_BASES.items() if k in d and b in d}),
            roofline=decode.roofline(machine.limits()),
        )
    machine.emit(out, a.out or None)


if __name__ == "__main__":
    main()
