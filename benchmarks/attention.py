"""Attention alone, forward + backward, against the sequence length, per implementation.

Prints JSON: the machine, the settings, then one row per (implementation, T) with the
milliseconds of a jitted ``value_and_grad`` of ``sum(attention(q, k, v) * w)`` over q, k
and v (causal self-attention, B=1, N heads of H=64), the same in process CPU time, and the
temporaries XLA's memory analysis reports for the compiled program (``temp_mib``).

Implementations: ``reference``, ``xla``, ``chunked`` (a ``MaskSpec``, causal blocks
skipped), ``chunked_full`` (chunked with no mask: every block computed, the measure of what
skipping saves) and ``cudnn`` (GPU only, on by default there). A dense path whose compiled
program needs more memory than ``--memory-fraction`` of the device's (or the host's) is
reported as skipped, not run. Each figure is the best of ``--repeats`` after a warm-up.
float32 on CPU; bfloat16 on GPU (``--dtype`` changes it).

    python benchmarks/attention.py [--lengths 512,1024,2048,4096] [--impls reference,chunked]
                                   [--block-q 256] [--block-k 256] [--repeats 5]

Rooflines (``benchmarks/machine.py``, measured in the same run): ``of_peak`` is the
useful FLOPs of causal attention forward + backward (6 B N T^2 H: the unmasked half of
q.k and weights.v, backward twice the forward) per second over the square matmul rate in
the same dtype (on a GPU, the table's dense bf16 peak).

``--long-context`` is the memory table at T = 8k / 32k / 128k: masks are described, never
built on the host, and ``--compile-only`` reports each program's temporaries without
running it. ``--device gpu --dry-run`` compiles the GPU settings (bfloat16, the fused XLA
path standing in for cuDNN, which cannot be compiled without a GPU) on a CPU.

``--flex`` measures ``ops.flex_attention`` per variant (plain causal, soft-cap, sliding
window, sinks, ALiBi, packed documents, FoX; ``--flex-variants``): forward + backward of q,
k, v and the arrays the score function closes over, its temporaries and its share of the
matmul roofline over the entries the mask allows, at T = 1k / 4k / 16k on a CPU (the
chunked path) or 8k / 32k / 128k on a GPU (the fused kernel, cuDNN's plain causal beside
it); ``--device gpu --dry-run --flex`` runs the GPU script's code path at tiny shapes here.

``--variants mha,sinks,gated,differential,mla`` measures the registered attention variants
instead (``attnlab.contracts.mixer``), each in a one-layer decoder (d_model 256, 4 heads, chunked
path): the train step (value and gradient of the loss over the parameters, causal, B=1) at
each length, with its temporaries, and cached greedy decoding (batch 1, 256 new tokens
after a prompt of 16) in tokens/s with the bytes of the variant's own cache per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import machine  # benchmarks/machine.py: the machine and its limits, measured in this run
import numpy as np

from attnlab import ops
from attnlab.ops.chunked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from attnlab.ops.masks import MaskSpec


def memory_budget(fraction):
    """Bytes a compiled program may use: a fraction of the device's memory (GPU) or RAM."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return fraction * stats["bytes_limit"]
    return fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def program(impl, T, args):
    """A jitted value-and-grad of one attention call, and its arguments."""
    shape_q = (args.batch, T, args.heads, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    if args.compile_only:  # shapes only: nothing is allocated
        q = k = v = w = jax.ShapeDtypeStruct(shape_q, dtype)
    else:
        q, k, v, w = (jax.random.normal(s, shape_q, jnp.float32).astype(dtype) for s in keys)
    blocks = dict(block_q=args.block_q, block_k=args.block_k)
    if impl == "chunked":
        mask, kw = MaskSpec.for_sequence(T, causal=True), dict(implementation="chunked", **blocks)
    elif impl == "chunked_full":
        mask, kw = None, dict(implementation="chunked", **blocks)
    elif args.long_context:  # the dense mask built inside the program, not on the host
        mask, kw = MaskSpec.for_sequence(T, causal=True), dict(implementation=impl)
    else:
        mask, kw = ops.causal(T), dict(implementation=impl)

    def loss(q, k, v, w, mask):
        out = ops.dot_product_attention(q, k, v, mask=mask, **kw)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (q, k, v, w, mask)


def timed(fn, inputs, row, args, budget, key="ms"):
    """Compiles ``fn`` on ``inputs`` and adds its compile time, temporaries and best wall and
    CPU milliseconds over ``args.repeats`` to ``row`` (skipped past the memory budget)."""
    t0 = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    row["compile_sec"] = round(time.perf_counter() - t0, 2)
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    row["temp_mib"] = None if temp is None else round(temp / 2**20, 1)
    if temp is not None and temp > budget:
        row["skipped"] = f"needs {temp / 2**30:.1f} GiB of temporaries, over the budget"
        return row
    if args.compile_only:
        return row | {"compile_only": True}
    jax.block_until_ready(compiled(*inputs))  # warm-up
    wall, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*inputs))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    row[key] = round(1e3 * min(wall), 2)
    row["cpu_" + key] = round(1e3 * min(cpu), 2)
    return row


def measure(impl, T, args, budget):
    fn, inputs = program(impl, T, args)
    row = timed(fn, inputs, dict(impl=impl, T=T), args, budget)
    if "ms" in row:  # the useful FLOPs per second over the machine's matmul peak
        flops = 6 * args.batch * args.heads * T * T * args.head_dim
        row["of_peak"] = round(flops / (row["ms"] / 1e3) / args.peak_flops, 4)
    return row


VARIANT_SETTINGS = {  # variants whose defaults do not fit the benchmark's model
    "mla": dict(kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=32,
                v_head_dim=64),
}  # fmt: skip


def variant_config(name, T, args):
    from attnlab import ModelConfig

    return ModelConfig(
        vocab_size=256, d_model=256, n_heads=4, n_layers=1, max_len=max(T, 272),
        position="rope", attention_impl="chunked", dtype=args.dtype, mixer=name,
        mixer_settings=VARIANT_SETTINGS.get(name),
    )  # fmt: skip


def measure_variant(name, T, args, budget):
    from flax import nnx

    from attnlab import build_model

    cfg = variant_config(name, T, args)
    graphdef, params = nnx.split(build_model(cfg, seed=0))
    ids = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)

    def loss(params, ids):
        logits = nnx.merge(graphdef, params)(ids).logits
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, ids[..., None], -1)[..., 0])  # fmt: skip

    fn = jax.jit(jax.value_and_grad(loss))
    return timed(fn, (params, ids), dict(variant=name, T=T), args, budget, key="step_ms")


def measure_variant_decoding(name, args):
    from attnlab import build_model, generate, kv_cache_bytes

    cfg = variant_config(name, 272, args)
    model = build_model(cfg, seed=0)
    prompt, new = [list(range(1, 17))], 256
    generate(model, prompt, new, eos_id=None)  # compile
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        generate(model, prompt, new, eos_id=None)
        times.append(time.perf_counter() - t0)
    return dict(
        variant=name,
        decode_tokens_per_s=round(new / min(times), 1),
        cache_bytes_per_token=kv_cache_bytes(cfg, 1, 1, dtype=args.dtype),
    )


def one_row(measure_fn, what: dict, *args):
    """``measure_fn(*args)``, or a row saying why it could not run; printed as it comes."""
    try:
        row = measure_fn(*args)
    except Exception as e:  # noqa: BLE001 - a path that cannot run is a result too
        row = what | {"skipped": f"{type(e).__name__}: {str(e)[:200]}"}
    print(json.dumps(row), flush=True)
    return row


def report(benchmark, host, settings, rows):
    limits = host.pop("limits", None)
    out = dict(
        benchmark=benchmark,
        machine=host | {"load_average_end": [round(x, 2) for x in os.getloadavg()]},
        limits=limits,
        settings=settings,
        results=rows,
    )
    print(json.dumps(out, indent=2))
    if settings.get("out"):
        with open(settings["out"], "w") as f:
            f.write(json.dumps(out, indent=2) + "\n")


def main_variants(args, budget, host):
    rows = []
    for name in args.variants.split(","):
        for T in (int(x) for x in args.lengths.split(",")):
            what = dict(variant=name, T=T)
            rows.append(one_row(measure_variant, what, name, T, args, budget))
        rows.append(one_row(measure_variant_decoding, dict(variant=name), name, args))
    report("attention_variants", host, vars(args), rows)


FLEX_VARIANTS = ("causal", "softcap", "window", "sinks", "alibi", "documents", "fox")
FLEX_WINDOW = 512  # the sliding window's keys
FLEX_DOCUMENTS = 4  # packed documents of T / 4 tokens each


def flex_program(variant, T, args):
    """A jitted value-and-grad of ``ops.flex_attention`` for one variant (gradients of q,
    k, v and of the arrays its score function closes over), its inputs and the number of
    (query, key) entries the variant's mask allows (the useful work)."""
    from attnlab.ops import score_mods

    B, N, H = args.batch, args.heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v, w = (jax.random.normal(s, (B, T, N, H), jnp.float32).astype(dtype) for s in keys[:4])
    causal = MaskSpec.for_sequence(T, causal=True)
    mask, extra, allowed = causal, (), T * (T + 1) // 2
    kw = dict(implementation=args.flex_impl, backend=args.backend)
    if args.flex_blocks:
        kw |= dict(block_q=args.block_q, block_k=args.block_k)
    mod = None
    if variant == "softcap":
        kw["softcap"] = 30.0
    elif variant == "window":
        window = min(FLEX_WINDOW, T)
        mask = MaskSpec.for_sequence(T, causal=True, window=window)
        allowed = window * (window + 1) // 2 + (T - window) * window
    elif variant == "sinks":
        extra = (jnp.zeros((N,), jnp.float32),)
    elif variant == "alibi":
        extra = (ops.alibi_slopes(N),)
        mod = lambda slopes: score_mods.alibi(slopes)  # noqa: E731
    elif variant == "documents":
        L = T // FLEX_DOCUMENTS
        segments = 1 + jnp.minimum(jnp.arange(T) // L, FLEX_DOCUMENTS - 1)
        mask = MaskSpec.for_sequence(T, causal=True, segment_ids=segments[None])
        allowed = FLEX_DOCUMENTS * L * (L + 1) // 2
    elif variant == "fox":
        gates = jax.random.normal(keys[4], (B, N, T), jnp.float32)
        extra = (jnp.cumsum(jax.nn.log_sigmoid(gates + 3.0), axis=-1),)
        mod = score_mods.forget_gate

    def loss(q, k, v, w, mask, *extra):
        options = dict(kw)
        if variant == "sinks":
            options["sinks"] = extra[0]
        elif mod is not None:
            options["score_mod"] = mod(*extra)
        out = ops.flex_attention(q, k, v, mask=mask, **options)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))

    argnums = tuple(range(3)) + tuple(5 + i for i in range(len(extra)))
    fn = jax.jit(jax.value_and_grad(loss, argnums=argnums))
    return fn, (q, k, v, w, mask, *extra), allowed


def measure_flex(variant, T, args, budget):
    if variant == "cudnn":  # the peer on a GPU: plain causal, cuDNN's fused kernel
        fn, inputs = program("cudnn", T, args)
        allowed = T * (T + 1) // 2
    else:
        fn, inputs, allowed = flex_program(variant, T, args)
    row = timed(fn, inputs, dict(variant=variant, T=T), args, budget)
    row["allowed_fraction"] = round(allowed / T**2, 4)
    if "ms" in row:  # useful FLOPs (12 H per allowed entry, forward + backward) over the peak
        flops = 12 * args.batch * args.heads * args.head_dim * allowed
        row["of_peak"] = round(flops / (row["ms"] / 1e3) / args.peak_flops, 4)
    return row


def main_flex(args, budget, host, gpu, dry):
    """``--flex``: every variant through ``ops.flex_attention`` ("auto": the chunked path on
    a CPU, the fused kernel on a GPU, with cuDNN's plain causal beside it)."""
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = args.flex_variants.split(",") + (["cudnn"] if gpu and not dry else [])
    repeats = args.repeats
    rows = []
    for T in lengths:
        args.repeats = max(1, repeats // 3) if T >= 16384 else repeats  # 16k: fewer
        for variant in variants:
            rows.append(one_row(measure_flex, dict(variant=variant, T=T), variant, T, args,
                                budget))  # fmt: skip
    args.repeats = repeats
    settings = vars(args) | {"budget_gib": round(budget / 2**30, 1), "window": FLEX_WINDOW,
                             "documents": FLEX_DOCUMENTS}  # fmt: skip
    report("flex_attention", host, settings, rows)


def main():
    gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    p.add_argument(
        "--impls",
        default=None,
        help="default reference,xla,chunked,chunked_full (+cudnn on a GPU or --device gpu)",
    )
    p.add_argument("--block-q", type=int, default=DEFAULT_BLOCK_Q)
    p.add_argument("--block-k", type=int, default=DEFAULT_BLOCK_K)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default=None, help="default float32 (gpu: bfloat16)")
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--variants", default="", help="attention variants to measure instead")
    p.add_argument("--long-context", action="store_true", help="T = 8k / 32k / 128k")
    p.add_argument("--compile-only", action="store_true", help="temporaries, not times")
    p.add_argument("--quick", action="store_true", help="seconds: T = 256 / 512")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--flex", action="store_true", help="flex attention's variants instead")
    p.add_argument("--flex-variants", default=",".join(FLEX_VARIANTS))
    p.add_argument("--flex-impl", default="auto", help="flex_attention's implementation")
    machine.add_device_flag(p)
    args = p.parse_args()
    dry = machine.check_device(args)
    args.flex_blocks = any(a.startswith(("--block-q", "--block-k")) for a in sys.argv)
    if args.flex:
        # CPU: 1k / 4k / 16k (a dry run: tiny shapes on this CPU); GPU: 8k / 32k / 128k.
        default = "1024,4096,16384" if not (gpu or args.device == "gpu") else "8192,32768,131072"
        if p.get_default("lengths") == args.lengths:
            args.lengths = "256,512" if dry else default
        args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
        args.backend = jax.default_backend()
    dry = dry and not args.flex  # --flex --dry-run runs its tiny shapes, timed
    gpu = gpu or args.device == "gpu"
    args.impls = args.impls or "reference,xla,chunked,chunked_full" + (",cudnn" if gpu else "")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if dry:  # cuDNN cannot be compiled without a GPU: the fused XLA path stands in
        args.dtype, args.compile_only = "bfloat16", True
        args.impls = ",".join("xla" if i == "cudnn" else i for i in args.impls.split(","))
    if args.long_context:
        args.lengths = "8192,32768,131072"
    if args.quick:
        args.lengths, args.repeats = "256,512", 2
    budget = memory_budget(args.memory_fraction)
    host = machine.describe()  # load_average: how busy the machine was when the runs began
    limits = machine.limits((), args.dtype, square=1024 if args.quick else 2048)
    peak = (limits["table_bf16_tflops"] or 0) * 1e12
    args.peak_flops = peak or limits["square_matmul_gflops"] * 1e9
    host |= {"limits": limits}
    if args.variants:
        return main_variants(args, budget, host)
    if args.flex:
        return main_flex(args, budget, host, gpu and not args.dry_run, args.dry_run)
    rows = [
        one_row(measure, dict(impl=impl, T=T), impl, T, args, budget)
        for T in (int(x) for x in args.lengths.split(","))
        for impl in args.impls.split(",")
    ]
    settings = vars(args) | {"causal": True, "budget_gib": round(budget / 2**30, 1)}
    report("attention", host, settings, rows)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
