"""Where a compiled step's time goes: matmuls against everything else, from a profile.

Runs a jitted function under ``jax.profiler`` (the Perfetto trace), matches each kernel in
the trace to its instruction in the compiled HLO, and sums kernel time by what the
instruction computes:

* ``matmul``: a dot or convolution (with whatever XLA fused into it);
* ``layout``: only moves data: copy, transpose, slice, dynamic-slice, dynamic-update-slice,
  pad, concatenate, gather, scatter, select over those (layer slices, cache writes,
  transposes around the scan);
* ``reduction``: contains a reduce (norms, softmax, the loss, gradient norms);
* ``elementwise``: the rest of the arithmetic (activations, the optimiser's update, masks);
* ``collective``: all-reduce and the like (a step split over several CPU devices).

Kernel time is summed over threads (two devices run kernels at once), so the shares read as
fractions of the CPU time spent in kernels; ``wall_ms`` is the call's own time, outside the
trace. Figures taken under load move; the shares move much less.

    python benchmarks/profile_step.py --train medium            # the 6 x 384 training step
    python benchmarks/profile_step.py --decode 1,8 [--new-tokens 64]   # GPT-2 small, per batch
    python benchmarks/profile_step.py --train gpt2 --device gpu   # bfloat16, cuDNN attention

Run training and decoding in separate processes: ``--train`` asks for one single-threaded
CPU device per core (as ``attnlab train`` does), which would leave decoding one thread.
``--out FILE`` writes the JSON that ``benchmarks/report.py`` turns into table rows.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax
import machine  # benchmarks/machine.py
import numpy as np

MATMUL = {"dot", "convolution"}
LAYOUT = {
    "copy", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "pad",
    "concatenate", "gather", "scatter", "select", "reverse", "reshape", "iota", "compare",
}  # fmt: skip
COLLECTIVE = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}
CONTAINERS = {"while", "conditional", "call", "tuple", "get-tuple-element", "parameter"}
_FREE = {"parameter", "bitcast", "constant", "broadcast", "tuple", "get-tuple-element"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(")


def instruction_ops(hlo_text: str) -> dict[str, set]:
    """Each instruction's name -> the ops it computes (a fusion's: those of its body)."""
    bodies, current, calls, ops = {}, None, {}, {}
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = bodies.setdefault(m.group(1), set())
            continue
        m = _INSTRUCTION.match(line)
        if not m or current is None:
            continue
        name, op = m.groups()
        current.add(op)
        ops[name] = {op}
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        if op == "fusion" and callee:
            calls[name] = callee.group(1)
    for name, body in calls.items():
        ops[name] = set(bodies.get(body, {"fusion"}))
    return {name: found - _FREE for name, found in ops.items()}


def category(ops: set) -> str | None:
    """What an instruction computing ``ops`` is counted as (None: a container such as a
    while loop, whose body's kernels are counted themselves)."""
    if ops & MATMUL or "custom-call" in ops:  # on a GPU: cuBLAS gemms, cuDNN attention
        return "matmul"
    if ops & COLLECTIVE:
        return "collective"
    if not ops or ops <= CONTAINERS:
        return None
    if ops <= LAYOUT:
        return "layout"
    if ops & {"reduce", "reduce-window"}:
        return "reduction"
    return "elementwise"


def kernel_times(trace_dir: str) -> collections.Counter:
    """Microseconds per event name in the newest Perfetto trace under ``trace_dir``."""
    path = max(glob.glob(f"{trace_dir}/**/*.json.gz", recursive=True), key=os.path.getmtime)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            out[e["name"]] += e.get("dur", 0)
    return out


def breakdown(call, hlo_text: str, *, prepare=lambda: None, calls: int = 2, top: int = 8):
    """Per ``call(x)`` (one run of a compiled program whose optimised HLO is ``hlo_text``,
    on an input ``x = prepare()`` made before the timing; it returns arrays to wait for):
    the wall time and the kernel time by ``category``, with the ``top`` instructions
    outside matmuls. ``call`` runs once before anything is timed."""
    ops = instruction_ops(hlo_text)
    jax.block_until_ready(call(prepare()))
    wall = float("inf")
    for _ in range(calls):
        x = jax.block_until_ready(prepare())
        t0 = time.perf_counter()
        jax.block_until_ready(call(x))
        wall = min(wall, time.perf_counter() - t0)
    inputs = [jax.block_until_ready(prepare()) for _ in range(calls)]
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for x in inputs:
            jax.block_until_ready(call(x))
        jax.profiler.stop_trace()
        times = kernel_times(trace_dir)
    by_kind, rest = collections.Counter(), collections.Counter()
    for name, us in times.items():
        kind = category(ops[name]) if name in ops else None
        if kind is None:
            continue
        by_kind[kind] += us
        if kind != "matmul":
            rest[f"{name} ({'+'.join(sorted(ops[name]))})"] += us
    total = sum(by_kind.values()) or 1
    ms = lambda us: round(us / calls / 1e3, 3)
    return dict(
        wall_ms=round(wall * 1e3, 3),
        kernel_ms=ms(total),
        share={k: round(v / total, 4) for k, v in by_kind.most_common()},
        kernel_ms_by_kind={k: ms(v) for k, v in by_kind.most_common()},
        top_not_matmul=[dict(kernel=k, ms=ms(v)) for k, v in rest.most_common(top)],
        # Every trace event by name, matched to HLO or not: host spans, and on a GPU the
        # kernels as CUDA names them (cuBLAS and cuDNN included), which the HLO does not.
        top_events=[dict(event=k, ms=ms(v)) for k, v in times.most_common(3 * top)],
    )


def train_step(shape: str, gpu: bool = False):
    """``breakdown``'s arguments for the training benchmark's step at ``shape`` (each call one
    step, the state donated and carried), on the CPU devices ``attnlab train`` uses, or with
    ``gpu`` on one GPU in bfloat16 with cuDNN attention (``train_throughput``'s setting)."""
    import train_throughput as tt

    from attnlab import devices, train
    from attnlab.devices import sharding

    s = tt.SHAPES[shape]
    overrides = [f"--config.model.{k}" for k in ("dtype=bfloat16", "attention_impl=cudnn")]
    cfg = tt.config_for(s, s.get("vocab", 65), overrides if gpu else [])
    n = 1 if gpu else devices.choose(cfg)
    mesh = sharding.make_mesh({"data": n}) if devices.apply(n) else None
    trainer = train.Trainer(cfg, kind="lm", mesh=mesh)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, s.get("vocab", 65), (s["batch"], s["seq_len"]), dtype=np.int32)
             for k in ("inputs", "targets")}  # fmt: skip
    batch["loss_mask"] = np.ones((s["batch"], s["seq_len"]), np.float32)
    state = [trainer.init_state()]
    hlo = trainer.train_step.lower(state[0], batch).compile().as_text()

    def call(_):
        state[0], metrics = trainer.train_step(state[0], batch)
        return metrics

    return dict(call=call, hlo_text=hlo)


def decode_loop(batch: int, new_tokens: int, prompt_len: int = 16, unstack: bool = False):
    """``breakdown``'s arguments for GPT-2 small's generation loop (``Decoder.sample_loop``,
    greedy, ``new_tokens`` tokens) after a prefill of ``prompt_len`` tokens; ``unstack``:
    the model's layers as separate blocks (``attnlab.decode.unstacked``)."""
    import decode as bench

    from attnlab import ModelConfig, build_model, init_cache
    from attnlab.decode import Decoder, SamplingConfig, unstacked
    from attnlab.decode.api import cache_slots

    cfg = ModelConfig(**bench.MODELS["gpt2"])
    model = build_model(cfg, seed=0)
    decoder, params = Decoder.for_model(unstacked(model) if unstack else model)
    ids = bench.prompts(batch, prompt_len, cfg.vocab_size)
    lengths = np.full((batch,), prompt_len, np.int32)
    slots = cache_slots(prompt_len + new_tokens, cfg.max_len)
    rest = (jax.random.key(0), np.int32(new_tokens), np.int32(-1), np.int32(0),
            SamplingConfig().traced())  # fmt: skip

    def prefilled():
        cache = init_cache(cfg, batch, slots)
        return decoder.prefill(params, cache, ids, lengths)  # (logits, cache)

    logits, cache = prefilled()
    hlo = decoder.sample_loop.lower(params, cache, logits, *rest, return_logits=False)

    def call(prefill):  # the loop alone: each call's prefill ran before the timing
        logits, cache = prefill
        return decoder.sample_loop(params, cache, logits, *rest, return_logits=False)["tokens_BS"]

    return dict(call=call, hlo_text=hlo.compile().as_text(), prepare=prefilled)


def main(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", default=None, help="a train_throughput.py shape, e.g. medium")
    p.add_argument("--decode", type=ints, default=[], help="GPT-2 small batch sizes, e.g. 1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--unstacked-model",
        action="store_true",
        help="decode with the layers as separate blocks (no per-call weight slices)",
    )
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    machine.add_device_flag(p)
    args = p.parse_args(argv)
    load = [round(x, 2) for x in os.getloadavg()]  # before the runs
    programs = {}
    if args.train:  # first: it may ask for one CPU device per core before JAX starts
        programs[f"train {args.train}"] = breakdown(
            **train_step(args.train, gpu=args.device == "gpu"), calls=args.calls
        )
        print(json.dumps({f"train {args.train}": programs[f"train {args.train}"]}), flush=True)
    host = machine.describe() | dict(load_average=load)  # after --train chose the devices
    for B in args.decode:
        name = f"decode gpt2 batch {B}, {args.new_tokens} tokens"
        name += ", unstacked" if args.unstacked_model else ""
        loop = decode_loop(B, args.new_tokens, unstack=args.unstacked_model)
        programs[name] = breakdown(**loop, calls=args.calls)
        print(json.dumps({name: programs[name]}), flush=True)
    out = dict(benchmark="profile", machine=host, xla_flags=os.environ.get("XLA_FLAGS", ""),
               programs=programs)  # fmt: skip
    machine.emit(out, args.out)


if __name__ == "__main__":
    main()
