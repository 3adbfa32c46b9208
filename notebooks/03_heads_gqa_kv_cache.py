# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Heads, GQA and the KV cache
#
# Multi-head attention (MHA) gives every query head its own key and value head. Grouped-query
# attention (GQA) lets groups of query heads share one key/value head, and multi-query
# attention (MQA) shares a single one among all. Fewer key/value heads mean fewer parameters
# and, more importantly at inference time, a smaller KV cache. This notebook computes both
# costs from configurations alone, checks the numbers for a real model shape (Qwen3-4B),
# verifies that prefill + cached decoding reproduces the full forward pass, and times cached
# against uncached decoding as the context grows.

# %%
# %matplotlib inline
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import treescope
from flax import nnx
from matplotlib.figure import Figure

import attnlab
from attnlab import ModelConfig, build_model, count_params, init_cache, kv_cache_bytes
from attnlab.pretrained import model_config_from_hf

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) shrinks the timed model and context lengths.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
CONTEXTS = [16, 32, 64] if TINY else [64, 128, 256, 512, 1024]
TIMED = (
    dict(d_model=32, n_layers=1, n_heads=4) if TINY else dict(d_model=128, n_layers=4, n_heads=8)
)
REPEATS = 3 if TINY else 20
MiB = 2**20

# %% [markdown]
# ## 1. MHA vs GQA vs MQA, from the configuration alone
#
# A 7B-class decoder shape: 32 layers, 32 query heads of size 128, context 4096. Only
# `n_kv_heads` changes. `count_params` builds the model abstractly (shapes only, nothing is
# allocated) and `kv_cache_bytes` is $2 \cdot L \cdot B \cdot S \cdot K \cdot H$ times the
# bytes per element: keys and values, for every layer, sequence slot and key/value head.

# %%
base = ModelConfig(
    vocab_size=32_000,
    d_model=4096,
    n_layers=32,
    n_heads=32,
    head_dim=128,
    d_ff=11_008,
    ffn="swiglu",
    norm="rmsnorm",
    position="rope",
    tie_embeddings=False,
    max_len=4096,
)
variants = {"MHA (32 kv heads)": 32, "GQA (8 kv heads)": 8, "MQA (1 kv head)": 1}
rows = []
for name, kv_heads in variants.items():
    cfg = base.replace(n_kv_heads=kv_heads)
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attention_per_layer = D * N * H + 2 * D * K * H + N * H * D  # q, k, v, o projections
    rows.append(
        dict(
            name=name,
            params=count_params(cfg),
            attention=attention_per_layer,
            cache=kv_cache_bytes(cfg, batch_size=1, max_len=4096, dtype="bfloat16"),
        )
    )

print(f"{'':20s} {'total params':>14s} {'attn params/layer':>18s} {'KV cache @4k bf16':>18s}")
for r in rows:
    print(f"{r['name']:20s} {r['params']:14,d} {r['attention']:18,d} {r['cache'] / MiB:14,.0f} MiB")

# %%
fig = Figure(figsize=(11, 3.6), layout="constrained")
ax1, ax2 = fig.subplots(1, 2)
names = [r["name"] for r in rows]
ax1.bar(names, [r["attention"] / 1e6 for r in rows], color=["C0", "C1", "C2"])
ax1.set(ylabel="millions", title="attention parameters per layer")
ax2.bar(names, [r["cache"] / MiB for r in rows], color=["C0", "C1", "C2"])
ax2.set(ylabel="MiB", title="KV cache, batch 1, 4096 tokens, 16-bit")
for ax in (ax1, ax2):
    ax.tick_params(axis="x", labelsize=8)
fig

# %%
mha, gqa, mqa = rows
assert mha["cache"] == 4 * gqa["cache"] == 32 * mqa["cache"]  # the cache scales with K
assert mha["cache"] == 2 * 32 * 4096 * 32 * 128 * 2 == 2 * 2**30  # 2 GiB for MHA
# Only the k and v projections shrink: 2 * D * (N - K) * H parameters per layer.
assert mha["params"] - gqa["params"] == 32 * 2 * 4096 * (32 - 8) * 128

# %% [markdown]
# ## 2. Qwen3-4B from its config.json
#
# The published shape of Qwen3-4B: 36 layers, 32 query heads and 8 key/value heads of size
# 128, QK-norm, tied embeddings. `attnlab.pretrained.model_config_from_hf` turns a Hugging
# Face `config.json` (a path or, as here, its dict) into the `ModelConfig` that
# `count_params` and `kv_cache_bytes` take.

# %%
qwen3_4b = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151_936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40_960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000,
    "tie_word_embeddings": True,
}
qwen3_4b_cfg = model_config_from_hf(qwen3_4b)  # the ModelConfig of that config.json
params_4b = count_params(qwen3_4b_cfg)
cache_4k = kv_cache_bytes(qwen3_4b_cfg, batch_size=1, max_len=4096, dtype="bfloat16")
print(f"Qwen3-4B: {params_4b:,d} parameters; KV cache at 4096 tokens: {cache_4k / MiB:.0f} MiB")
assert params_4b == 4_022_468_096
assert cache_4k == 576 * MiB  # 2 * 36 layers * 4096 * 8 kv heads * 128 * 2 bytes

# %% [markdown]
# ## 3. Prefill + cached decode equals the full forward pass
#
# The cache is an explicit pytree (`attnlab.init_cache`): keys and values of every layer,
# `[B, K, S, H]`, and each row's length. Calling a decoder with `cache=` appends the new
# tokens' keys and values at each row's length and returns the updated cache. Feeding a
# prompt at once (prefill) and then one token at a time must give the same logits as one
# pass over the whole sequence.

# %%
small = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    position="rope",
    norm="rmsnorm",
    ffn="swiglu",
    max_len=32,
    init_std=0.2,  # larger than the default, so logits are O(1) and differences would show
)
model = build_model(small, seed=0)
graphdef, params = nnx.split(model)


@jax.jit
def forward(params, tokens_BT):
    """Logits of a whole sequence, no cache."""
    return nnx.merge(graphdef, params)(tokens_BT).logits


@jax.jit
def extend(params, cache, tokens_BT):
    """Appends ``tokens_BT`` to the cache; their logits and the new cache."""
    out = nnx.merge(graphdef, params)(tokens_BT, cache=cache)
    return out.logits, out.cache


B, T, P = 2, 20, 8  # batch, total length, prompt length
tokens_BT = jax.random.randint(jax.random.key(0), (B, T), 0, small.vocab_size)
full_BTV = forward(params, tokens_BT)

cache = init_cache(small, batch_size=B, max_len=small.max_len)
print("cache layout [L, B, K, S, H]:", cache.k.shape, "lengths", cache.lengths)
step_logits, cache = extend(params, cache, tokens_BT[:, :P])  # prefill
pieces = [step_logits]
for t in range(P, T):  # decode one token at a time
    step_logits, cache = extend(params, cache, tokens_BT[:, t : t + 1])
    pieces.append(step_logits)
cached_BTV = jnp.concatenate(pieces, axis=1)

max_diff = float(jnp.abs(cached_BTV - full_BTV).max())
print(f"logits std {float(full_BTV.std()):.2f}; cache lengths {cache.lengths}")
print(f"max |prefill+decode - full forward| = {max_diff:.2e}")
assert cached_BTV.shape == full_BTV.shape
assert max_diff <= 1e-5
assert (np.asarray(cache.lengths) == T).all()
stored = cache.k.nbytes + cache.v.nbytes
assert stored == kv_cache_bytes(small, B, small.max_len, dtype="float32")

# %% [markdown]
# Both are pytrees, and `treescope` draws them as trees: folded, each array with its shape,
# dtype and a summary of its values; click a node to unfold it. The model's parameters are
# stacked on the layer axis (`q_DNH` is `[L, D, N, H]`, the letters of `attnlab.dims`); the
# cache holds each role (`keys`, `values`) as `[L, B, K, S, H]`, only the K = 2 key/value
# heads, with each row's length.

# %%
treescope.display(model)
treescope.display(cache)

# %% [markdown]
# ## 4. Cached vs uncached decoding
#
# Without a cache, producing the next token means running the whole context again: the
# cost of a step grows with the context (linearly in the projections and MLP, quadratically
# in attention). With a cache, a step processes one token and reads the stored keys and
# values: its cost grows only through that read. Below: one step's time at each context
# length (a cache sized to the context, the same model, both jitted once per shape).

# %%
timed_cfg = ModelConfig(vocab_size=256, position="rope", max_len=max(CONTEXTS), **TIMED)
timed_model = build_model(timed_cfg, seed=0)
timed_graph, timed_params = nnx.split(timed_model)
timed_forward = jax.jit(lambda p, t: nnx.merge(timed_graph, p)(t).logits[:, -1])


@jax.jit
def timed_step(p, cache, token_B1):
    out = nnx.merge(timed_graph, p)(token_B1, cache=cache)
    return out.logits[:, -1], out.cache


def best_time(fn, *args):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


uncached_ms, cached_ms = [], []
for n in CONTEXTS:
    context_1N = jax.random.randint(jax.random.key(n), (1, n), 0, timed_cfg.vocab_size)
    uncached_ms.append(1e3 * best_time(timed_forward, timed_params, context_1N))
    # What the cache holds does not change a step's cost, only its size and fill do: an empty
    # cache of capacity n, marked as holding n - 1 tokens, times the step at context n.
    cache = init_cache(timed_cfg, batch_size=1, max_len=n)
    cache = cache.replace(lengths=jnp.array([n - 1], jnp.int32))
    cached_ms.append(1e3 * best_time(timed_step, timed_params, cache, context_1N[:, -1:]))
    print(f"context {n:5d}: uncached {uncached_ms[-1]:8.3f} ms   cached {cached_ms[-1]:8.3f} ms")

# %%
fig = Figure(figsize=(6.5, 4), layout="constrained")
ax = fig.add_subplot()
ax.plot(CONTEXTS, uncached_ms, "o-", label="uncached: rerun the whole context")
ax.plot(CONTEXTS, cached_ms, "s-", label="cached: one token + KV cache")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set(xlabel="context length", ylabel="ms per generated token", title="one decoding step")
ax.grid(alpha=0.3)
ax.legend()
fig

# %%
assert all(np.isfinite(uncached_ms)) and all(np.isfinite(cached_ms))
if not TINY:  # at the full sizes the gap is large enough to be reliable on any CPU
    assert cached_ms[-1] < uncached_ms[-1], (cached_ms, uncached_ms)
