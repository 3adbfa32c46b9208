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
# # Prototype an attention variant
#
# A new attention idea should take minutes to try: write it as a pure function, register it
# under a name, select it in a config, train. No library file changes. This notebook does
# that for two variants of the score function and compares them with standard softmax
# attention over a few seeds.
#
# * **Soft-capped logits**: $\ell \mapsto c \tanh(\ell / c)$ before the softmax, so no
#   score exceeds $c$ in size and no single key can take all the weight.
# * **Cosine attention**: queries and keys normalised to unit length, scores
#   $\tau \cos(q, k)$ with a fixed temperature $\tau$.

# %%
# %matplotlib inline
import math
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from matplotlib.figure import Figure

import attnlab
from attnlab import ModelConfig, build_model, ops, viz
from attnlab.data import make_task
from attnlab.experiment import load_config
from attnlab.sweep import grid, markdown_table, plan_sweep, run_sweep

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) trains tiny models for a few steps, one seed.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
SEEDS = [0] if TINY else [0, 1]
STEPS = 10 if TINY else 200
SIZE = (
    dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=32)
    if TINY
    else dict(d_model=64, n_layers=2, n_heads=4, d_ff=192, seq_len=64)
)
CAP = 5.0  # soft-cap of the attention logits
TAU = 10.0  # temperature of cosine attention

# %% [markdown]
# ## 1. The variants as pure functions
#
# A variant has the signature of `attnlab.ops.dot_product_attention`: `q [B, T, N, H]`,
# `k, v [B, S, K, H]` and keyword arguments (`mask`, `bias`, `scale`, `return_weights`,
# `implementation`). Both variants below delegate to it: soft-capping through its
# `score_mod` hook (`score_mod(score, b, h, q_idx, kv_idx)`, applied to each scaled logit
# before masking, so every path runs it: the chunked one on a CPU, a fused kernel on a GPU),
# cosine attention by normalising its inputs and fixing the scale.


# %%
def softcap_attention(q_BTNH, k_BSKH, v_BSKH, *, cap=CAP, **kwargs):
    """Softmax attention of ``cap * tanh(logits / cap)``."""
    score_mod = lambda s, b, h, q_idx, kv_idx: cap * jnp.tanh(s / cap)
    return ops.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, score_mod=score_mod, **kwargs)


def cosine_attention(q_BTNH, k_BSKH, v_BSKH, *, scale=None, tau=TAU, **kwargs):
    """Softmax attention of ``tau * cos(q, k)``; the model's scale is ignored."""
    unit = lambda x: x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
    return ops.dot_product_attention(unit(q_BTNH), unit(k_BSKH), v_BSKH, scale=tau, **kwargs)


# %% [markdown]
# Quick checks on random inputs. With logits far larger than the cap, plain softmax puts
# all weight on one key; capped logits lie in $(-c, c)$, so the top weight is at most
# $1 / (1 + (S - 1) e^{-2c})$. A cap far above every logit changes nothing.

# %%
B, T, N, H = 2, 16, 4, 16
q, k, v = jax.random.normal(jax.random.key(0), (3, B, T, N, H))
mask = ops.causal(T)
sharp_q = 30.0 * q  # logits of size ~ 30 * sqrt(H)

_, w_plain = ops.dot_product_attention(sharp_q, k, v, mask=mask, return_weights=True)
_, w_capped = softcap_attention(sharp_q, k, v, mask=mask, return_weights=True)
_, w_cosine = cosine_attention(sharp_q, k, v, mask=mask, return_weights=True)
bound = 1 / (1 + (T - 1) * math.exp(-2 * CAP))  # for the last query, which sees all T keys
last = lambda w: float(w[:, :, -1].max())
print(f"top weight of the last query: plain {last(w_plain):.3f}, capped {last(w_capped):.3f}")
assert last(w_plain) > 0.99
assert last(w_capped) <= bound + 1e-6
_, w_cosine_unscaled = cosine_attention(q, k, v, mask=mask, return_weights=True)
assert float(jnp.abs(w_cosine - w_cosine_unscaled).max()) < 1e-5, "only q's direction counts"
loose = softcap_attention(q, k, v, mask=mask, cap=1e4)
assert float(jnp.abs(loose - ops.dot_product_attention(q, k, v, mask=mask)).max()) < 1e-5

fig = Figure(figsize=(11, 3.6), layout="constrained")
panels = {"plain softmax": w_plain, f"soft-capped (c = {CAP:g})": w_capped, "cosine": w_cosine}
for ax, (title, w) in zip(fig.subplots(1, 3), panels.items(), strict=True):
    image = ax.imshow(w[0, 0], vmin=0.0, vmax=1.0)
    ax.set(title=title, xlabel="key", ylabel="query")
fig.colorbar(image, ax=fig.axes, shrink=0.8, label="weight")
fig

# %% [markdown]
# ## 2. Register and plug into a model
#
# `attnlab.register_attention(name, fn)` makes `fn` selectable as
# `ModelConfig(attention_fn=name)` in every architecture; nothing else changes.
# (`overwrite=True` lets this cell run again in the same kernel.)

# %%
attnlab.register_attention("softcap", softcap_attention, overwrite=True)
attnlab.register_attention("cosine", cosine_attention, overwrite=True)
print(sorted(attnlab.attention_variants()))

tokens_BT = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
outputs = {}
for name in ("softmax", "softcap", "cosine"):
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_len=16, attention_fn=name
    )
    graphdef, params = nnx.split(build_model(cfg, seed=0))  # same seed: the same parameters
    run = jax.jit(lambda p, t, g=graphdef: nnx.merge(g, p)(t, return_weights=True))
    outputs[name] = run(params, tokens_BT)

for name, out in outputs.items():
    weights = out.weights[0]["self"]
    assert jnp.allclose(weights.sum(-1), 1.0, atol=1e-5)
    gap = float(jnp.abs(out.logits - outputs["softmax"].logits).max())
    print(f"{name:8s} logits differ from the softmax model's by {gap:.2e}")
assert float(jnp.abs(outputs["cosine"].logits - outputs["softmax"].logits).max()) > 1e-6

# %% [markdown]
# At initialisation the logits are tiny (weights drawn with std 0.02), far below the cap,
# so the soft-capped model starts out as the softmax one; the cap acts only once training
# sharpens the logits. Cosine attention changes the model from the first step.

# %% [markdown]
# ## 3. A small comparison
#
# Each variant trains the same character-level model on the embedded corpus
# (`experiments/char_lm.py`, shrunk) for a few seeds: `attention_fn` is just another config
# value, so the comparison is an ordinary sweep (`attnlab.sweep`). Trials that differ only in
# their seed share one program and train together, vmapped; each variant is its own group.

# %%
ROOT = next(
    p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "experiments").is_dir()
)
spec = str(ROOT / "experiments" / "char_lm.py") + (":tiny" if TINY else "")
overrides = [f"--config.model.{key}={value}" for key, value in SIZE.items() if key != "seq_len"] + [
    f"--config.model.max_len={SIZE['seq_len']}",
    f"--config.data.seq_len={SIZE['seq_len']}",
    f"--config.train.steps={STEPS}",
    "--config.train.batch_size=16",
    f"--config.train.log_every_steps={5 if TINY else 50}",
    f"--config.eval.every_steps={STEPS if TINY else 50}",
    "--config.eval.batches=4",
    "--config.eval.sample_tokens=0",
    f"--config.checkpoint.every_steps={STEPS}",
    "--config.optim.learning_rate=3e-3",
    f"--config.optim.warmup_steps={2 if TINY else 20}",
]
vocab_size = make_task(load_config(spec, overrides).data).vocab_size
overrides.append(f"--config.model.vocab_size={vocab_size}")

VARIANTS = ["softmax", "softcap", "cosine"]
plan = plan_sweep(spec, overrides, grid({"model.attention_fn": VARIANTS, "train.seed": SEEDS}))
root = pathlib.Path(tempfile.mkdtemp(prefix="attnlab_variants_"))
results = run_sweep(plan, root)

# %%
print(markdown_table(results))
first_seed = [t for t in plan.trials if t.overrides["train.seed"] == SEEDS[0]]
viz.plot_loss_curves(
    [root / t.name for t in first_seed],
    labels=[t.overrides["model.attention_fn"] for t in first_seed],
    title=f"attention variants (seed {SEEDS[0]})",
)

# %%
final = {v: [] for v in VARIANTS}
for row in results["trials"]:
    final[row["overrides"]["model.attention_fn"]].append(row["final_eval_loss"])
final = {v: np.array(losses) for v, losses in final.items()}
fig = Figure(figsize=(5.5, 3.6), layout="constrained")
ax = fig.add_subplot()
ax.bar(VARIANTS, [final[v].mean() for v in VARIANTS], color=["C0", "C1", "C2"], alpha=0.6)
for i, v in enumerate(VARIANTS):
    ax.plot(np.full(len(final[v]), i), final[v], "ko", ms=4)
low, high = min(x.min() for x in final.values()), max(x.max() for x in final.values())
ax.set_ylim(low - 0.2, high + 0.1)
ax.set(ylabel="final eval loss (nats/char)", title=f"{len(SEEDS)} seed(s) per variant (dots)")
fig

# %%
uniform = math.log(vocab_size)
assert len(results["trials"]) == len(VARIANTS) * len(SEEDS)
for row in results["trials"]:
    assert row["status"] == "finished" and row["steps"] == STEPS, row
    assert row["final_eval_loss"] is not None and math.isfinite(row["final_eval_loss"]), row
    if not TINY:
        assert row["final_eval_loss"] < uniform - 1.0, f"{row['trial']} did not learn"
