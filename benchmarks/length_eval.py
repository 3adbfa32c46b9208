"""Time and memory of ``attnlab eval --lengths`` and ``--tasks`` on this machine.

A freshly initialised decoder (the shape of ``experiments/length_positions.py``: 2 layers,
d_model 64, 4 heads, RoPE, a 96-symbol vocabulary) is scored at each ``--lengths`` on
``--tokens`` tokens per length in ``chunks`` mode, and on RULER-style ``--tasks`` with
``--examples`` examples per task and length. Per length it prints the wall time (compilation
included: each length is a new program), the compiled prefill step's temporaries and the KV
cache's bytes (XLA's memory analysis; linear in the length), the process's peak RSS so
far, and the FLOP rate it reached: per scored token, twice the parameters of the layers
(the embedding is a lookup) and the causal attention's 4 x d_model x layers x (length / 2)
multiply-adds, against the machine's matmul rate measured in the same run
(``benchmarks/machine.py``), the roofline of a program that is matmuls.

    python benchmarks/length_eval.py [--lengths 1024,4096,16384] [--tokens 16384] [--out F]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import jax
import jax.numpy as jnp
import machine as bench_machine  # benchmarks/machine.py
import numpy as np
from flax import nnx

from attnlab import ModelConfig, build_model
from attnlab.data.tokenizers import ByteTokenizer
from attnlab.evaluation import length, ruler
from attnlab.kv_cache import init_cache


def _mib(n):
    return round(n / 2**20, 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    p.add_argument("--tokens", type=int, default=16_384)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--tasks", default="niah_single,niah_multikey,vt,passkey")
    p.add_argument("--task-lengths", default="1024,4096,16384")
    p.add_argument("--examples", type=int, default=4)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths + [int(x) for x in args.task_lengths.split(",")]) + 64
    cfg = ModelConfig(arch="decoder", vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                      d_ff=192, max_len=longest, position="rope", norm="rmsnorm",
                      ffn="swiglu", attention_impl="chunked")  # fmt: skip
    state = nnx.state(build_model(cfg, seed=0))
    embed = cfg.vocab_size * cfg.d_model  # the input embedding: a lookup, no FLOPs
    matmul_params = sum(int(x.size) for x in jax.tree.leaves(state)) - embed
    ids = np.random.default_rng(0).integers(0, 256, args.tokens + max(lengths) + 1)
    tok = ByteTokenizer()
    scorable = length.Scorable("bench", cfg, state, ids, None, "", 128,
                               encode=lambda t: [int(i) for i in tok.encode(t)],
                               decode=tok.decode)  # fmt: skip
    graphdef, state = length.merged(cfg, state)
    report = {"config": vars(args), "machine": bench_machine.describe(), "lengths": [],
              "tasks": []}  # fmt: skip
    for n in lengths:
        B, C = max(1, min(args.tokens // n, 16_384 // n)), length.chunk_for(n, args.chunk)
        cache = init_cache(cfg, B, n)
        x = jax.ShapeDtypeStruct((B, C), jnp.int32)
        m = jax.ShapeDtypeStruct((B, C), jnp.float32)
        compiled = length.score_step().lower(graphdef, state, cache, x, x, m).compile()
        mem = compiled.memory_analysis()
        t0 = time.perf_counter()
        row = length.score_length(graphdef, state, cfg, ids, n, "chunks", tokens=args.tokens,
                                  chunk=args.chunk)  # fmt: skip
        seconds = time.perf_counter() - t0
        flops = row["tokens"] * (2 * matmul_params + 4 * cfg.d_model * cfg.n_layers * n / 2)
        report["lengths"].append({
            "length": n, "rows": B, "chunk": C, "tokens": row["tokens"],
            "seconds": round(seconds, 2),
            "tokens_per_s": round(row["tokens"] / seconds),
            "gflops": round(flops / seconds / 1e9, 2),
            "step_temp_mib": _mib(mem.temp_size_in_bytes),
            "cache_mib": _mib(sum(x.nbytes for x in jax.tree.leaves(cache))),
            "peak_rss_mib": _mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        })  # fmt: skip
        print(json.dumps(report["lengths"][-1]), flush=True)
    for n in [int(x) for x in args.task_lengths.split(",")]:
        t0 = time.perf_counter()
        out = ruler.evaluate_tasks(scorable, args.tasks, [n], examples=args.examples)
        report["tasks"].append({
            "length": n, "tasks": len(out["accuracy"]), "examples": args.examples,
            "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss_mib": _mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        })  # fmt: skip
        print(json.dumps(report["tasks"][-1]), flush=True)
    report["devices"] = str(jax.devices())
    report["limits"] = limits = bench_machine.limits()
    for row in report["lengths"]:
        row["fraction_of_matmul_rate"] = round(row["gflops"] / limits["square_matmul_gflops"], 4)
    bench_machine.emit(report, args.out)


if __name__ == "__main__":
    main()
