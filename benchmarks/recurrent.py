"""Recurrent-state layers against attention on this machine: decode speed and cache bytes per
sequence against context length, and prefill time of the chunked forms.

Decoders of one width and depth at matched parameter count (the FFN width of each is set so
that every model has the largest one's parameters, within one FFN column), one per ``MODELS``
row: ``mha`` (RoPE, a KV cache that grows with the context); the fixed-state layers
``gated_deltanet``, ``mamba2``, ``mamba`` (Mamba-1's selective scan) and ``short_conv`` (a
gated short convolution, LFM2's form; a conv state only); ``fox`` (softmax attention with a
forget gate: a KV cache like ``mha`` plus a cumulative gate per token); the sparse-attention
mixers (a KV cache, reading only the selected keys' blocks); and the 3:1 hybrid
(``ModelConfig.block_pattern``: three Gated DeltaNet layers, then one attention layer,
repeated; ``--n-layers`` a multiple of 4), whose cache grows with the context at a quarter
of attention's rate.

Prints one JSON object: the settings, the machine (CPU model, cores, load average at the
start and the end), each model's parameters, and

* ``decode``: per context length (batch 1), milliseconds per generated token (the slope of
  the generation loop's time between ``--short`` and ``--long`` new tokens; its CPU time
  beside it), tokens/s, and the cache bytes per sequence (``kv_cache_bytes``). The cache is
  filled by setting each row's length to the context, not by a prefill: the step reads the
  same number of cached keys whatever they hold, and a 64k-token attention prefill would
  cost minutes here;
* ``prefill``: milliseconds of the library's prefill (``Decoder.prefill``, one row) of
  ``--prefill-lengths`` tokens into an empty cache.

The roofline (``limits``: this machine's square float32 matmul FLOP/s and read bytes/s,
measured in the same run, ``benchmarks/machine.py``) beside each row: a decode step cannot
beat reading the weights and the row's cache once (``roofline_tokens_per_s``, the
bandwidth or compute bound, whichever binds, and ``of_roofline``: the fraction reached;
``decode.roofline``, shared with ``benchmarks/decode.py``); a
prefill cannot beat its dense FLOPs at the matmul peak (``roofline_ms``: 2 FLOPs a
parameter a token, plus causal attention's scores and weighted sum in the attention
layers). The chunked forms' within-chunk work is not counted, so for the recurrent layers
the bound is lower than their true minimum and ``of_roofline`` understates how close
they come.

Every program is compiled before it is timed; each figure is the best of ``--repeats``.
The default is a quick run; the figures of docs/benchmarks.md came from

    python benchmarks/recurrent.py --lengths 1024,4096,16384,65536 \\
        --prefill-lengths 1024,4096,16384
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time

import flax
import jax
import jax.numpy as jnp
import machine as bench_machine  # benchmarks/machine.py (this file has a machine() of its own)
import numpy as np
from decode import attention_layers, roofline  # benchmarks/decode.py: one decode roofline

from attnlab import ModelConfig, build_model, count_params, init_cache, kv_cache_bytes
from attnlab.decode import Decoder, SamplingConfig

BASE = dict(vocab_size=256, norm="rmsnorm", ffn="swiglu", position="rope", tie_embeddings=True)
# name -> its ModelConfig fields. The recurrent layers keep their defaults (Mamba-2: expand 2,
# state size 128; Gated DeltaNet: as many key as value heads of the model's head width).
MODELS = {
    "attention": {"mixer": "mha"},
    "gated_deltanet": {"mixer": "gated_deltanet"},
    "mamba2": {"mixer": "mamba2"},
    "mamba": {"mixer": "mamba"},
    "short_conv": {"mixer": "short_conv"},
    "fox": {"mixer": "fox", "position": "none"},
    "lightning": {"mixer": "lightning"},
    "kda": {"mixer": "kda"},
    "dsa": {"mixer": "dsa"},  # MLA over the indexer's top 2048 keys
    "moba": {"mixer": "moba"},  # the top 3 past blocks of 64 and its own
    "nsa": {"mixer": "nsa"},  # compressed, selected (16 of 64) and a window of 512
    "hybrid_3to1": {"block_pattern": {"block": ["gated_deltanet"] * 3 + ["mha"]}},
}


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def best(fn, repeats):
    """Best (wall, CPU) seconds of ``fn()`` over ``repeats`` runs after a compiling one."""
    jax.block_until_ready(fn())
    runs = []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), cpu_seconds()
        jax.block_until_ready(fn())
        runs.append((time.perf_counter() - w0, cpu_seconds() - c0))
    return min(w for w, _ in runs), min(c for _, c in runs)


def machine():
    return dict(
        cpu=bench_machine.cpu_model(),
        cores=os.cpu_count(),
        load_average=list(os.getloadavg()),
        platform=platform.platform(),
        jax=jax.__version__,
        flax=flax.__version__,
        backend=jax.default_backend(),
    )


def prefill_roofline(row, cfg, limits):
    """Adds the prefill's dense-FLOP roofline to ``row`` (see the module docstring)."""
    T = row["tokens"]
    flops = 2 * count_params(cfg) * T + 2 * attention_layers(cfg) * T * T * cfg.d_model
    bound_ms = 1e3 * flops / (limits["square_matmul_gflops"] * 1e9)
    row.update(roofline_ms=round(bound_ms, 2), of_roofline=round(bound_ms / row["ms"], 4))
    return row


def configs(args) -> dict[str, ModelConfig]:
    """The models at matched parameter count: each FFN widened to the largest model's total."""
    max_len = max(args.lengths + args.prefill_lengths) + args.long + 8
    common = dict(BASE, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads)
    cfgs = {
        name: ModelConfig(**(common | fields), max_len=max_len) for name, fields in MODELS.items()
    }
    target = max(count_params(c) for c in cfgs.values())
    per_column = 3 * args.d_model * args.n_layers  # a SwiGLU column: gate, in, out
    return {
        name: c.replace(d_ff=c.d_ff + round((target - count_params(c)) / per_column))
        for name, c in cfgs.items()
    }


def loop_seconds(decoder, params, cfg, context, n, repeats):
    """Best (wall, CPU) seconds of ``n`` greedy steps after a ``context``-token cache."""

    def run():
        cache = init_cache(cfg, 1, context + n + 1)
        cache = cache.replace(lengths=jnp.full((1,), context, jnp.int32))
        return decoder.sample_loop(
            params, cache, jnp.zeros((1, cfg.vocab_size)), jax.random.key(0), np.int32(n),
            np.int32(-1), np.int32(0), SamplingConfig().traced(), return_logits=False,
        )  # fmt: skip

    return best(run, repeats)


def decode_rows(name, model, args, limits):
    cfg, rows = model.cfg, []
    decoder, params = Decoder.for_model(model)
    for c in args.lengths:
        short = loop_seconds(decoder, params, cfg, c, args.short, args.repeats)
        long = loop_seconds(decoder, params, cfg, c, args.long, args.repeats)
        ms = 1e3 * (long[0] - short[0]) / (args.long - args.short)
        row = dict(
            model=name, context=c, ms_per_token=round(ms, 4), tokens_per_s=round(1e3 / ms, 1),
            cpu_ms_per_token=round(1e3 * (long[1] - short[1]) / (args.long - args.short), 4),
            cache_bytes_per_sequence=kv_cache_bytes(cfg, 1, c, "float32", ring=False),
        )  # fmt: skip
        rows.append(roofline(row, cfg, limits, context=c))
        print(json.dumps(row), flush=True)
    return rows


def prefill_rows(name, model, args, limits):
    cfg, rows = model.cfg, []
    decoder, params = Decoder.for_model(model)
    for T in args.prefill_lengths:
        ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (1, T), dtype=np.int32)
        lengths = np.full((1,), T, np.int32)
        run = lambda ids=ids, lengths=lengths, T=T: decoder.prefill(
            params, init_cache(cfg, 1, T + 1), ids, lengths
        )
        wall, cpu = best(run, args.repeats)
        row = dict(model=name, tokens=T, ms=round(1e3 * wall, 2), cpu_ms=round(1e3 * cpu, 2))
        rows.append(prefill_roofline(row, cfg, limits))
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=ints, default=[128, 512], help="decode contexts")
    parser.add_argument("--prefill-lengths", type=ints, default=[128, 512])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--short", type=int, default=4, help="new tokens of the short loop")
    parser.add_argument("--long", type=int, default=36, help="new tokens of the long loop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    out = dict(settings=vars(args), machine=machine(), models={}, decode=[], prefill=[])
    out["limits"] = limits = bench_machine.limits()
    cfgs = configs(args)
    for name in args.models.split(","):
        cfg = cfgs[name]
        model = build_model(cfg, seed=0)
        pattern = cfg.block_pattern
        out["models"][name] = dict(
            mixer=cfg.mixer,
            mixer_settings=cfg.mixer_settings.to_dict(),
            block_pattern=None if pattern is None else pattern.to_dict(),
            d_ff=cfg.d_ff,
            params=count_params(cfg),
        )
        out["decode"] += decode_rows(name, model, args, limits)
        out["prefill"] += prefill_rows(name, model, args, limits)
    bench_machine.emit(out, args.out)


if __name__ == "__main__":
    main()
