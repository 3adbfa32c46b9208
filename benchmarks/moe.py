"""Mixture-of-experts FFN step time per token against the dense FFN of equal active
parameters, on this machine (CPU by default).

A "step" is the jitted forward and backward pass of one FFN sub-layer over ``B x T`` tokens
(the gradient of the summed output with respect to its parameters and input). Compared:

* ``dense``: a SwiGLU FFN of width ``top_k * d_expert`` (the active parameters of the MoE);
* ``moe``: ``ffn_variant="moe"`` (router, top-k, tokens sorted by expert, ``ragged_dot``);
* ``moe_every_expert``: the same experts run on every token and masked (the dense
  reference of the tests), what dropless dispatch saves.

Also the cached decoding speed (``attnlab.generate``, greedy) of a tiny Mixtral-shaped
model (RoPE, RMSNorm, GQA, 8 SwiGLU experts top-2) against its dense twin of equal active
parameters: new tokens per second for ``--decode-batch`` rows of ``--decode-tokens``.

Prints one JSON object: the config, the machine and, per variant, ms per step, us per
token and the ratio to ``dense``; under ``decode``, tokens/s per model.

    python benchmarks/moe.py [--d-model 256] [--experts 8] [--top-k 2] [--d-expert 256]
                             [--decode-batch 4] [--decode-tokens 64]
                             [--batch 8] [--seq 256] [--repeats 10] [--quick] [--device gpu]

Roofline (``benchmarks/machine.py``, measured in the same run): ``of_peak`` is each step's
useful FLOPs (3 matmuls of the active width, forward + backward: 18 x tokens x d_model x
top_k x d_expert) per second over the matmul rate at the step's own shape
``[tokens, d_model] @ [d_model, top_k * d_expert]``; ``--device gpu`` computes in bfloat16.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import machine  # benchmarks/machine.py: the machine and its limits, measured in this run
from flax import nnx

from attnlab import ModelConfig, build_model, generate
from attnlab.nn.layers import FeedForward
from attnlab.nn.moe import MoE
from attnlab.ops.activations import activation


def every_expert(module: MoE, x_BTD):
    """All experts on all tokens, then the chosen ones kept (no dispatch)."""
    B, T, D = x_BTD.shape
    x_TD = x_BTD.reshape(B * T, D)
    expert_TA, weight_TA, _, _ = module.route(x_TD)
    gate_TE = (
        jnp.zeros((B * T, module.settings.n_experts))
        .at[jnp.arange(B * T)[:, None], expert_TA]
        .add(weight_TA)
    )
    h_ETF = jnp.einsum("TD,EDF->ETF", x_TD, module.w_in_EDF[...])
    g_ETF = jnp.einsum("TD,EDF->ETF", x_TD, module.w_gate_EDF[...])
    y_ETD = jnp.einsum("ETF,EFD->ETD", activation("swiglu")(g_ETF) * h_ETF, module.w_out_EFD[...])
    return jnp.einsum("TE,ETD->TD", gate_TE, y_ETD).reshape(B, T, D)


def step_ms(module, call, x_BTD, repeats: int) -> float:
    graphdef, params = nnx.split(module)

    def loss(p, x):
        out = call(nnx.merge(graphdef, p), x)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    jax.block_until_ready(step(params, x_BTD))  # compile
    best = float("inf")
    for _ in range(3):  # the best of three timed rounds
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = step(params, x_BTD)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return 1e3 * best


def decode_tokens_per_sec(a, dtype=None) -> dict:
    """Greedy cached decoding of a tiny Mixtral-shaped model and its dense twin."""
    shape = dict(
        vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, max_len=256,
        position="rope", norm="rmsnorm", ffn="swiglu", tie_embeddings=False,
    )  # fmt: skip
    models = {
        "mixtral_shaped": ModelConfig(
            **shape, ffn_variant="moe", ffn_settings=dict(n_experts=8, top_k=2, d_expert=128)
        ),
        "dense_twin": ModelConfig(**shape, d_ff=2 * 128),
    }
    prompt = jax.random.randint(jax.random.key(2), (a.decode_batch, 16), 0, 256)
    out = {}
    for name, cfg in models.items():
        model = build_model(cfg, seed=0)
        generate(model, prompt, a.decode_tokens, dtype=dtype)  # compiles; ids come back
        t0 = time.perf_counter()
        generate(model, prompt, a.decode_tokens, dtype=dtype)
        seconds = time.perf_counter() - t0
        out[name] = dict(
            tokens_per_sec=round(a.decode_batch * a.decode_tokens / seconds, 1),
            seconds=round(seconds, 3),
        )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-expert", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="seconds: 2 x 64 tokens, 8 new")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    machine.add_device_flag(p)
    a = p.parse_args()
    dry = machine.check_device(a)  # a dry run computes the GPU's dtype on this CPU
    if a.quick or dry:
        a.batch, a.seq, a.repeats, a.decode_tokens = 2, 64, 2, 8
    dtype = machine.GPU_DTYPE if a.device == "gpu" else "float32"
    host = machine.describe()
    tokens, width = a.batch * a.seq, a.top_k * a.d_expert
    limits = machine.limits([(tokens, a.d_model, width)], dtype, square=1024 if a.quick else 2048)
    peak = limits["matmul_gflops"][f"{tokens}x{a.d_model}x{width}"] * 1e9
    settings = dict(n_experts=a.experts, top_k=a.top_k, d_expert=a.d_expert)
    base = dict(d_model=a.d_model, n_heads=4, n_layers=1, ffn="swiglu", dtype=dtype)
    dense_cfg = ModelConfig(**base, d_ff=a.top_k * a.d_expert)
    moe_cfg = ModelConfig(**base, ffn_variant="moe", ffn_settings=settings)
    dense = FeedForward(dense_cfg, rngs=nnx.Rngs(0))
    moe = MoE(moe_cfg, moe_cfg.ffn_settings, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (a.batch, a.seq, a.d_model), jnp.float32)
    x = x.astype(dtype)
    runs = {
        "dense": step_ms(dense, lambda m, x: m(x), x, a.repeats),
        "moe": step_ms(moe, lambda m, x: m(x), x, a.repeats),
        "moe_every_expert": step_ms(moe, every_expert, x, a.repeats),
    }
    count = lambda m: int(sum(v.size for v in jax.tree.leaves(nnx.state(m, nnx.Param))))
    report = dict(
        benchmark="moe_ffn_step",
        config=dict(vars(a), tokens_per_step=tokens, activation="swiglu", dtype=dtype),
        params=dict(
            dense=count(dense),
            moe_total=count(moe),
            moe_active=count(moe) - (a.experts - a.top_k) * 3 * a.d_model * a.d_expert,
        ),
        results={
            name: dict(
                ms_per_step=round(ms, 3),
                us_per_token=round(1e3 * ms / tokens, 4),
                vs_dense=round(ms / runs["dense"], 3),
                of_peak=round(18 * tokens * a.d_model * width / (ms / 1e3) / peak, 4),
            )
            for name, ms in runs.items()
        },
        decode=dict(
            batch=a.decode_batch, new_tokens=a.decode_tokens, **decode_tokens_per_sec(a, dtype)
        ),
        device=a.device + (" (dry run)" if dry else ""),
        machine=host,
        limits=limits,
    )
    machine.print_json(report, a.out)


if __name__ == "__main__":
    main()
