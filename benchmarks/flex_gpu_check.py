"""The Pallas flex kernel against cuDNN on a GPU: forward + backward time and temporaries.

Prints JSON: the machine, the settings, then one row per (variant, implementation, T) with
the milliseconds of a jitted ``value_and_grad`` of ``sum(attention(q, k, v) * w)`` over q, k
and v, the TFLOP/s of the useful work (4 B N H x the allowed (query, key) pairs for the
forward, 2.5x that for forward + backward), and the temporaries XLA reports for the program.

Variants: ``causal`` (plain causal self-attention) and ``gemma2`` (Gemma-2 style: softcap
50, a sliding window of 4096 keys, one sink logit per head). Peers: ``cudnn``
(``jax.nn.dot_product_attention(implementation="cudnn")``), which for ``gemma2`` runs the
causal window without the softcap and sinks (it takes neither): the cost of the mask alone.

    python benchmarks/flex_gpu_check.py [--lengths 8192,32768] [--heads 8] [--kv-heads 8]
        [--head-dim 128] [--block-q 128] [--block-k 64] [--repeats 3]
    python benchmarks/flex_gpu_check.py --dry-run   # tiny shapes, interpret mode, on a CPU

``--dry-run`` runs every row at T = 32 and 48 on the CPU in Pallas interpret mode with XLA's
attention standing in for cuDNN, so the script is known to work before GPU time is spent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402  (benchmarks/machine.py)

from attnlab.ops.masks import MaskSpec  # noqa: E402
from attnlab.ops.pallas import flex_gpu  # noqa: E402


def _variant(name, T, N, window):
    if name == "causal":
        return (
            dict(mask=MaskSpec.for_sequence(T, causal=True)),
            dict(is_causal=True),
            T * (T + 1) / 2,
        )
    if name == "gemma2":
        spec = MaskSpec.for_sequence(T, causal=True, window=window)
        flex = dict(mask=spec, softcap=50.0, sinks=jnp.zeros((N,), jnp.float32))
        pairs = sum(min(t + 1, window) for t in range(T))
        return flex, dict(is_causal=True, local_window_size=(window - 1, 0)), pairs
    raise ValueError(f"unknown variant {name!r}")


def _row(fn, args, repeats):
    w = jax.random.normal(jax.random.key(1), args[0].shape, args[0].dtype)
    loss = lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = None if mem is None else mem.temp_size_in_bytes / 2**20
    seconds = machine.best_seconds(lambda: jax.block_until_ready(step(*args)), repeats)
    return seconds, temp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--variants", default="causal,gemma2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    interpret = a.dry_run
    lengths = [int(x) for x in a.lengths.split(",")]
    peer_impl = "cudnn"
    if a.dry_run:
        lengths, a.heads, a.kv_heads, a.head_dim = [32, 48], 2, 1, 16
        a.window, a.block_q, a.block_k, a.repeats, peer_impl = 8, 16, 16, 1, "xla"
    dtype = jnp.dtype(a.dtype)
    settings = {k: v for k, v in vars(a).items()} | dict(peer=peer_impl, lengths=lengths)
    print(json.dumps(dict(machine=machine.describe(), settings=settings)), flush=True)
    B, N, K, H = a.batch, a.heads, a.kv_heads, a.head_dim
    for T in lengths:
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (B, T, N, H), dtype)
        k = jax.random.normal(keys[1], (B, T, K, H), dtype)
        v = jax.random.normal(keys[2], (B, T, K, H), dtype)
        for name in a.variants.split(","):
            flex_kw, peer_kw, pairs = _variant(name, T, N, a.window)
            flops = 2.5 * 4 * B * N * H * pairs
            impls = {
                "pallas_gpu": lambda q, k, v, kw=flex_kw: flex_gpu.flex_attention_gpu(
                    q, k, v, block_q=a.block_q, block_k=a.block_k, interpret=interpret, **kw
                ),
                peer_impl: lambda q, k, v, kw=peer_kw: jax.nn.dot_product_attention(
                    q, k, v, implementation=peer_impl if peer_impl == "cudnn" else None, **kw
                ),
            }
            if name == "causal" and a.dry_run:  # the refusal the dispatcher would print
                reason = flex_gpu.supports(q, k, v, block_q=a.block_q, interpret=False)
                print(json.dumps(dict(variant=name, T=T, gpu_supports=reason)), flush=True)
            for impl, fn in impls.items():
                try:
                    seconds, temp = _row(fn, (q, k, v), a.repeats)
                except Exception as e:  # a peer that cannot take the shape: say so, go on
                    row = dict(variant=name, impl=impl, T=T, error=" ".join(str(e).split())[:300])
                    print(json.dumps(row), flush=True)
                    continue
                row = dict(variant=name, impl=impl, T=T, ms=round(seconds * 1e3, 3),
                           tflops=round(flops / seconds / 1e12, 3), temp_mib=temp)  # fmt: skip
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
