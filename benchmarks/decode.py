"""Decoding speed on this machine: the KV cache against full recomputation.

Prints JSON: the machine, the settings, then

* ``throughput``: tokens/s of greedy generation (random weights, float32) at each batch
  size, with the cache (``attnlab.decode.generate``, end to end: prefill, loop and the copy
  to the host) and by full recomputation (one jitted loop that re-runs the model over a
  fixed ``[B, prompt + new]`` buffer for every token, the head on the needed position only);
  ``minor_page_faults`` counts the pages of fresh memory one cached call touches (4 KiB
  each: a stacked model's call copies every layer's weights out of the stack into new
  buffers, ~90k faults for GPT-2 small; ``--unstacked-model`` none; ``--out-in-weights``
  also stores the layer weights output axes first);
* ``compile``: seconds of the first cached generation (tracing and compiling every program)
  and of a steady one, for 4, 16 and 32 layers of one width: the stack scanned with the
  generation loop scanning too (``decode_layers="scan"``) or running separate blocks
  (``"unstacked"``), and the stack unrolled;
* ``per_token``: milliseconds per generated token at each context length (batch 1): cached
  = the slope of the generation loop's time against the tokens it generates after a
  ``context``-token prefill, recompute = one full forward pass over ``context`` tokens.

Every program is compiled before it is timed; each figure is the best of ``--repeats``.
Next to each wall-clock figure stands the same from this process's CPU time (``cpu``):
XLA:CPU runs these steps on one thread, so on a machine shared with other work the CPU
time is the steadier measure of the code itself (``machine.load_average`` says how busy
the machine was).

``--sliding-window W`` gives every layer a window of W keys, so the cache is a ring buffer
of W slots (``--linear-cache`` keeps ``max_len`` slots); ``--prefill-chunk C`` prefills
prompts C tokens at a time. ``models`` reports the bytes per row of both caches.

    python benchmarks/decode.py [--quick] [--models small,gpt2] [--batches 1,8]
                                [--contexts 64,256,1024] [--skip-recompute]
                                [--sliding-window 128] [--linear-cache] [--prefill-chunk 256]
    python benchmarks/decode.py --device gpu [--peer]   # gpt2, bf16, batch 1/8/64

Rooflines (``benchmarks/machine.py``, measured in the same run): each cached row's
``roofline_tokens_per_s`` is what the machine allows: a step reads the weights once for
the batch and each row's cache (its mean valid length over the generation) at the read
rate (a matrix-vector product over 512 MiB; a copy's rate counts its writes as well), and
does 2 x params + the attention FLOPs per token at the square matmul rate (the GPU table's
bf16 peak with ``--device gpu``): batch 1 is bound by bandwidth, large batches by compute.
``of_roofline`` is the measured fraction. ``--peer`` runs ``transformers``'
``generate`` back to back in this process (skipped without torch/transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import flax
import jax
import jax.numpy as jnp
import machine as limits_of  # benchmarks/machine.py: the machine's limits, measured in this run
import numpy as np
from flax import nnx

from attnlab import ModelConfig, build_model, count_params, init_cache, kv_cache_bytes
from attnlab.decode import Decoder, SamplingConfig, generate, unstacked
from attnlab.decode.api import cache_slots
from attnlab.experiment.presets import GPT2_SMALL

MODELS = {
    "small": dict(n_layers=4, n_heads=4, d_model=128, vocab_size=256, max_len=1024),
    "gpt2": GPT2_SMALL,
}


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn):
    """(wall seconds, this process's CPU seconds) of one ``fn()``, finished on the device."""
    w0, c0 = time.perf_counter(), cpu_seconds()
    jax.block_until_ready(fn())
    return time.perf_counter() - w0, cpu_seconds() - c0


def minor_faults(fn):
    """Minor page faults of one ``fn()``: pages of fresh memory the call touches first (on
    Linux each costs a kernel entry and zeroing; a call that copies weights into new
    buffers shows here)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(fn())
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def best_time(fn, repeats):
    """Best wall and best CPU seconds over ``repeats`` runs, after a compiling run."""
    fn()
    runs = [timed(fn) for _ in range(repeats)]
    return min(w for w, _ in runs), min(c for _, c in runs)


def prompts(B, P, vocab, seed=0):
    return np.random.default_rng(seed).integers(1, vocab, (B, P), dtype=np.int32)


def recompute_fn(model):
    """Greedy generation by re-running the model on the whole sequence for every token."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, buf_BW, P, n):
        model = nnx.merge(graphdef, params)
        rows_B = jnp.arange(buf_BW.shape[0])

        def body(i, buf_BW):
            h_BWD = model(buf_BW).hidden  # causal: what lies past P + i cannot matter
            h_B1D = h_BWD[rows_B, P + i - 1][:, None]
            token_B = jnp.argmax(model.head(h_B1D, model.embed.tokens)[:, 0], axis=-1)
            return buf_BW.at[rows_B, P + i].set(token_B.astype(buf_BW.dtype))

        return jax.lax.fori_loop(0, n, body, buf_BW)

    return lambda buf, P, n: run(params, buf, P, n)


def last_token_forward(model):
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, ids_BT):
        model = nnx.merge(graphdef, params)
        h_BTD = model(ids_BT).hidden
        return model.head(h_BTD[:, -1:], model.embed.tokens)

    return lambda ids: run(params, ids)


def throughput(name, model, args):
    cfg, rows = model.cfg, []
    options = dict(ring=args.ring, prefill_chunk=args.prefill_chunk, dtype=args.dtype)
    for B in args.batches:
        ids = prompts(B, args.prompt_len, cfg.vocab_size)
        n = args.new_tokens
        call = lambda ids=ids, n=n: generate(model, ids, n, **options).tokens
        wall, cpu = best_time(call, args.repeats)
        rows.append(
            dict(model=name, batch=B, mode="cached", prompt_len=args.prompt_len, new_tokens=n,
                 cache_len=cache_slots(args.prompt_len + n, cfg.max_len), seconds=wall,
                 tokens_per_s=B * n / wall,
                 cpu_seconds=cpu, tokens_per_cpu_s=B * n / cpu, dtype=args.dtype or "float32",
                 minor_page_faults=minor_faults(call))
        )  # fmt: skip
        roofline(rows[-1], cfg, args.limits)
        if args.peer and name == "gpt2":  # transformers' GPT-2 small
            rows[-1]["peer_transformers"] = p = peer(B, args)
            if "tokens_per_s" in p:
                rows[-1]["vs_peer"] = round(rows[-1]["tokens_per_s"] / p["tokens_per_s"], 3)
                p["of_roofline"] = round(p["tokens_per_s"] / rows[-1]["roofline_tokens_per_s"], 4)
        print(json.dumps(rows[-1]), flush=True)
        if args.skip_recompute:
            continue
        n = args.recompute_tokens
        buf = np.zeros((B, args.prompt_len + n), np.int32)
        buf[:, : args.prompt_len] = ids
        run = recompute_fn(model)
        wall, cpu = best_time(
            lambda buf=buf, n=n, run=run: run(buf, args.prompt_len, n), args.repeats
        )
        rows.append(
            dict(model=name, batch=B, mode="recompute", prompt_len=args.prompt_len,
                 new_tokens=n, seconds=wall, tokens_per_s=B * n / wall, cpu_seconds=cpu,
                 tokens_per_cpu_s=B * n / cpu)
        )  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def loop_seconds(decoder, params, cfg, ids, n, args):
    """Best (wall, CPU) seconds of the generation loop alone, after a prefill of ``ids``."""
    runs = []
    for _ in range(args.repeats + 1):  # the first run compiles
        cache = init_cache(cfg, ids.shape[0], cfg.max_len, ring=args.ring)
        lengths = np.full((ids.shape[0],), ids.shape[1], np.int32)
        logits, cache = jax.block_until_ready(
            decoder.prefill(params, cache, ids, lengths, chunk=args.prefill_chunk)
        )
        runs.append(
            timed(
                lambda logits=logits, cache=cache: decoder.sample_loop(
                    params, cache, logits, jax.random.key(0), np.int32(n), np.int32(-1),
                    np.int32(0), SamplingConfig().traced(), return_logits=False,
                )
            )
        )  # fmt: skip
    return min(w for w, _ in runs[1:]), min(c for _, c in runs[1:])


def ring_cache(cfg, args) -> bool:
    """Whether the cached runs use a ring buffer (shapes only: nothing is allocated)."""
    return jax.eval_shape(lambda: init_cache(cfg, 1, cfg.max_len, ring=args.ring)).ring


def per_token(name, model, args):
    cfg, rows = model.cfg, []
    decoder, params = Decoder.for_model(model)
    short, long = 4, 4 + args.slope_tokens
    forward = last_token_forward(model)
    for c in args.contexts:
        ids = prompts(1, c, cfg.vocab_size)
        t_short = loop_seconds(decoder, params, cfg, ids, short, args)
        t_long = loop_seconds(decoder, params, cfg, ids, long, args)
        row = dict(model=name, context=c, batch=1, cache_len=cfg.max_len,
                   cached_ms=1e3 * (t_long[0] - t_short[0]) / (long - short),
                   cached_cpu_ms=1e3 * (t_long[1] - t_short[1]) / (long - short))  # fmt: skip
        if not args.skip_recompute:
            wall, cpu = best_time(lambda ids=ids: forward(ids), args.repeats)
            row.update(recompute_ms=1e3 * wall, recompute_cpu_ms=1e3 * cpu)
        row["tokens_per_s"] = 1e3 / max(row["cached_ms"], 1e-6)  # the loop alone, batch 1
        rows.append(roofline(row, cfg, args.limits, context=c))
        print(json.dumps(row), flush=True)
    return rows


def machine():
    return limits_of.describe() | dict(
        flax=flax.__version__,
        # Huge pages for malloc'd buffers change the cost of a call's fresh memory (README).
        glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
        transparent_hugepage=_thp_mode(),
    )


def attention_layers(cfg) -> int:
    """How many of the stack's layers run softmax attention (whose cache grows and whose
    scores cost FLOPs per cached token)."""
    from attnlab.config.layer_kinds import stack_plan

    return sum(spec.mixer == "mha" for spec in stack_plan(cfg, cfg.n_layers).mixer_specs)


def roofline(row, cfg, limits, context=None):
    """Adds to a cached ``row`` the tokens/s the machine allows and the fraction reached
    (``context``: the valid cache length; default the mean over the row's generation; the
    row's ``batch``, default 1). The weights and each row's cache are read once a step at
    the read rate; the FLOPs are 2 a parameter plus the attention layers' scores and sum."""
    dtype = row.get("dtype", "float32")
    if context is None:
        context = row["prompt_len"] + row["new_tokens"] // 2
    params = count_params(cfg)
    gpu_peak = (limits["table_bf16_tflops"] or 0) * 1e12
    bound, binding = limits_of.decode_bound(
        batch=row.get("batch", 1),
        weight_bytes=params * jnp.dtype(dtype).itemsize,
        cache_bytes_per_row=kv_cache_bytes(cfg, 1, context, dtype, ring=False),
        flops_per_token=2 * params + 4 * attention_layers(cfg) * context * cfg.d_model,
        bytes_per_s=max(limits["read_gbps"].values()) * 1e9,
        flops_per_s=gpu_peak or limits["square_matmul_gflops"] * 1e9,
    )
    row.update(roofline_tokens_per_s=round(bound, 1), bound_by=binding,
               of_roofline=round(row["tokens_per_s"] / bound, 4))  # fmt: skip
    return row


def peer(batch, args):
    """``transformers``' greedy generate at ``batch``, or why it was skipped."""
    try:
        import torch_reference

        return torch_reference.decode_throughput(
            batch, args.new_tokens, args.prompt_len, args.repeats,
            device="cuda" if args.device == "gpu" else "cpu", dtype=args.dtype or "float32",
        )  # fmt: skip
    except ImportError as e:
        return dict(skipped=f"no PyTorch/transformers: {e}")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"


def compile_time(args):
    """First-call (compile) and steady seconds of a cached generation against depth, for
    scanned and unrolled stacks of the same width."""
    rows = []
    # The stack scanned or unrolled (the prefill), the generation loop scanned or unstacked.
    modes = [(True, "scan"), (True, "unstacked"), (False, "unstacked")]
    for scan, decode_layers in modes:
        for L in args.compile_layers:
            cfg = ModelConfig(
                **COMPILE_MODEL, n_layers=L, scan_layers=scan, decode_layers=decode_layers
            )
            model = build_model(cfg, seed=0)
            ids = prompts(1, args.prompt_len, cfg.vocab_size)
            start = time.perf_counter()
            generate(model, ids, 8).tokens  # noqa: B018 (traces and compiles every program)
            first = time.perf_counter() - start
            steady, _ = best_time(lambda m=model, ids=ids: generate(m, ids, 8).tokens, 2)
            rows.append(
                dict(
                    n_layers=L,
                    scan_layers=scan,
                    decode_layers=decode_layers,
                    first_call_sec=round(first, 3),
                    steady_sec=round(steady, 4),
                    compile_sec=round(first - steady, 3),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


COMPILE_MODEL = dict(d_model=256, n_heads=4, vocab_size=256, max_len=256)


def main(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, short contexts")
    parser.add_argument("--models", default=None, help="default small,gpt2 (gpu: gpt2)")
    parser.add_argument("--batches", type=ints, default=None, help="default 1,8 (gpu: 1,8,64)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--recompute-tokens", type=int, default=16)
    parser.add_argument("--contexts", type=ints, default=[64, 256, 1024])
    parser.add_argument("--slope-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-recompute", action="store_true")
    parser.add_argument("--skip-contexts", action="store_true")
    parser.add_argument("--compile-layers", type=ints, default=[4, 16, 32])
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument(
        "--decode-layers", default="auto", help="ModelConfig.decode_layers for the throughput"
    )
    parser.add_argument(
        "--unstacked-model",
        action="store_true",
        help="generate with attnlab.decode.unstacked(model): the layers held as separate "
        "blocks once, as a model kept only for generation (default: build_model's stacked "
        "model, each call slicing the layers itself)",
    )
    parser.add_argument(
        "--out-in-weights",
        action="store_true",
        help="as --unstacked-model, and the layer weights stored output axes first "
        "(unstacked(model, out_in=True): faster matrix-vector products at batch 1)",
    )
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument(
        "--dtype", default=None, help="decode in this dtype (generate's dtype), e.g. bfloat16"
    )
    parser.add_argument("--linear-cache", action="store_true", help="no ring buffer")
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument("--peer", action="store_true", help="transformers' generate (gpt2)")
    parser.add_argument("--out", default=None, help="also write the JSON to this file")
    limits_of.add_device_flag(parser)
    args = parser.parse_args(argv)
    args.ring = False if args.linear_cache else None
    dry, gpu = limits_of.check_device(args), args.device == "gpu"
    args.models = args.models or ("gpt2" if gpu else "small,gpt2")
    args.batches = args.batches or ([1, 8, 64] if gpu else [1, 8])
    args.dtype = args.dtype or (limits_of.GPU_DTYPE if gpu else None)  # bf16 weights + caches
    if args.quick:
        args.models, args.contexts, args.repeats = "small", [64], 2
        args.skip_compile = True
    if dry:  # the GPU settings run on the small model, for shape and argument errors only
        args.models, args.new_tokens, args.repeats, args.peer = "small", 4, 1, False
        args.skip_contexts = args.skip_compile = args.skip_recompute = True
    host = machine()  # the load before the runs
    args.limits = limits_of.limits(
        (), args.dtype or "float32", square=1024 if args.quick or dry else 2048
    )
    settings = {k: v for k, v in vars(args).items() if k != "limits"}
    settings |= {"dtype": args.dtype or "float32", "dry_run": dry}
    out = dict(machine=host, limits=args.limits, settings=settings, models={})
    out["throughput"], out["per_token"] = [], []
    for name in args.models.split(","):
        cfg = ModelConfig(
            **MODELS[name], decode_layers=args.decode_layers, sliding_window=args.sliding_window
        )
        if not args.skip_contexts and max(args.contexts) + 4 + args.slope_tokens > cfg.max_len:
            # Room to generate after the longest context: the position table grows; the
            # throughput figures use the same model.
            cfg = cfg.replace(max_len=max(args.contexts) + 64)
        model = build_model(cfg, seed=0)
        out["models"][name] = dict(
            MODELS[name],
            max_len=cfg.max_len,
            params=count_params(cfg),
            kv_cache_bytes_per_row=kv_cache_bytes(cfg, 1, cfg.max_len, "float32", ring=False),
            ring_kv_cache_bytes_per_row=(
                kv_cache_bytes(cfg, 1, cfg.max_len, "float32", ring=True)
                if args.sliding_window
                else None
            ),
            cache="ring" if ring_cache(cfg, args) else "linear",
        )
        if args.unstacked_model or args.out_in_weights:
            model = unstacked(model, out_in=args.out_in_weights)
        out["throughput"] += throughput(name, model, args)
        if not args.skip_contexts:
            out["per_token"] += per_token(name, model, args)
    if not args.skip_compile:
        out["compile"] = compile_time(args)
    limits_of.emit(out, args.out)


if __name__ == "__main__":
    main()
