"""GPT-2 small's batch-1 generation loop with its weights in either layout, alternated in one
process: ``unstacked(model)`` (the weights as the model holds them, input axes first)
against ``unstacked(model, out_in=True)`` (attention and FFN weights output axes first).

The machine's memory bandwidth moves from minute to minute when it is shared, so separate
runs of ``benchmarks/decode.py`` compare the layouts poorly; here both programs are
compiled first and then timed in turn, ``--rounds`` times: each round's figure is the loop's
milliseconds per token (the slope between a short and a long generation after the same
64-token prefill, as ``decode.py``'s ``per_token`` rows). Prints JSON with the machine, the
read rate and the weight-streaming bound (``decode.roofline``), every round, and for each
layout the best and the median with their fractions of the bound.

    python benchmarks/decode_layouts.py [--rounds 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import decode as bench  # benchmarks/decode.py
import jax
import machine  # benchmarks/machine.py
import numpy as np

from attnlab import ModelConfig, build_model, init_cache
from attnlab.decode import Decoder, SamplingConfig, unstacked

CONTEXT, SHORT, LONG = 64, 4, 36


def loop_timer(model, cfg):
    """``seconds(n)``: one generation loop of ``n`` tokens after a fresh prefill."""
    decoder, params = Decoder.for_model(model)
    ids = bench.prompts(1, CONTEXT, cfg.vocab_size)
    lengths = np.full((1,), CONTEXT, np.int32)

    def seconds(n):
        cache = init_cache(cfg, 1, CONTEXT + LONG)
        logits, cache = jax.block_until_ready(decoder.prefill(params, cache, ids, lengths))
        t0 = time.perf_counter()
        out = decoder.sample_loop(
            params, cache, logits, jax.random.key(0), np.int32(n), np.int32(-1), np.int32(0),
            SamplingConfig().traced(), return_logits=False,
        )  # fmt: skip
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    seconds(SHORT), seconds(LONG)  # compiles
    return seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    host = bench.machine()
    limits = machine.limits()
    cfg = ModelConfig(**bench.MODELS["gpt2"])
    model = build_model(cfg, seed=0)
    timers = {
        "in_out": loop_timer(unstacked(model), cfg),
        "out_in": loop_timer(unstacked(model, out_in=True), cfg),
    }
    rounds = {name: [] for name in timers}
    for _ in range(args.rounds):
        for name, seconds in timers.items():
            slope = (seconds(LONG) - seconds(SHORT)) / (LONG - SHORT)
            rounds[name].append(round(1e3 * slope, 3))
    summary = {}
    for name, ms in rounds.items():
        best, median = min(ms), float(np.median(ms))
        row = bench.roofline(
            dict(batch=1, tokens_per_s=1e3 / median), cfg, limits, context=CONTEXT + LONG // 2
        )
        bound = row["roofline_tokens_per_s"]
        summary[name] = dict(
            best_ms=best, median_ms=median, roofline_tokens_per_s=bound,
            of_roofline_median=row["of_roofline"], of_roofline_best=round(1e3 / best / bound, 4),
        )  # fmt: skip
    out = dict(benchmark="decode_layouts", machine=host, limits=limits,
               settings=dict(model="gpt2", context=CONTEXT, short=SHORT, long=LONG,
                             rounds=args.rounds), rounds=rounds, summary=summary)  # fmt: skip
    machine.emit(out, args.out)


if __name__ == "__main__":
    main()
