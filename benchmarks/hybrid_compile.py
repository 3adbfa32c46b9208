"""Compile time of a hybrid stack against its depth: scanned over the block's repeats, and
unrolled (``scan_layers=False``).

Prints JSON: the machine, then one row per (program, mode, repeats) with the seconds to trace
and lower the program, the seconds to compile it and the size of its StableHLO text. The
stack is a 3:1 hybrid (``block_pattern``: three ``sinks`` layers, then one ``mla`` layer,
repeated) at d_model 64; the programs are the training gradient (B=2, T=32) and one cached
decode step (B=2, a cache of 64 tokens). Scanned, both stay flat in the repeats; unrolled,
they grow with them.

    python benchmarks/hybrid_compile.py [--repeats 2,8]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from decode import machine  # benchmarks/decode.py: the machine description all scripts print
from flax import nnx

from attnlab import ModelConfig, build_model, init_cache
from attnlab.decode import Decoder

BLOCK = ["sinks", "sinks", "sinks", "mla"]


def config(repeats: int, scan: bool) -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=64, n_heads=4, max_len=64, position="rope",
                       norm="rmsnorm", n_layers=len(BLOCK) * repeats, scan_layers=scan,
                       block_pattern={"block": BLOCK})  # fmt: skip


def programs(cfg: ModelConfig):
    """``name -> (jitted function, abstract arguments)``."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed=0)))
    ids_BT = jax.ShapeDtypeStruct((2, 32), jnp.int32)

    def loss(p, ids_BT):
        return jnp.mean(nnx.merge(graphdef, p)(ids_BT).logits)

    decoder = Decoder(graphdef, cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, cfg.max_len))
    token_B = jax.ShapeDtypeStruct((2,), jnp.int32)
    return {
        "train_grad": (jax.jit(jax.grad(loss)), (params, ids_BT)),
        "decode_step": (jax.jit(decoder.decode_step_fn), (params, cache, token_B)),
    }


def measure(fn, args) -> dict:
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"trace_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3),
            "hlo_chars": len(lowered.as_text())}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", default="2,8")
    args = parser.parse_args()
    rows = []
    for scan in (True, False):
        for repeats in (int(r) for r in args.repeats.split(",")):
            cfg = config(repeats, scan)
            for name, (fn, fn_args) in programs(cfg).items():
                row = {"program": name, "mode": "scan" if scan else "unrolled"}
                row |= {"repeats": repeats, "layers": cfg.n_layers, **measure(fn, fn_args)}
                rows.append(row)
    print(json.dumps({"machine": machine(), "block": BLOCK, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
