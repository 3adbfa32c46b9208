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
# # Attention from scratch
#
# Scaled dot-product attention, first by hand in NumPy on a four-token example, then through
# `attnlab.ops.dot_product_attention`. Then: why the logits are divided by $\sqrt{d_k}$, why
# every row of weights sums to one, and what the masks of `attnlab.ops` look like.
#
# $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right)V$$

# %%
# %matplotlib inline
import os

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

import attnlab
from attnlab import ops, viz

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) shrinks the sampling experiment.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
NUM_SAMPLES = 2_000 if TINY else 20_000  # random (q, k) pairs per width
HEAD_DIMS = [2, 8, 32, 128, 512] if TINY else [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
NUM_KEYS = 32  # keys each random query attends over

# %% [markdown]
# ## 1. A worked example by hand
#
# Four tokens with four-dimensional embeddings (the rows of `X`), and projections to a
# two-dimensional head. Each row of a weight matrix is one output dimension, so
# $Q = X W_Q^\top$, $K = X W_K^\top$, $V = X W_V^\top$.

# %%
X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=np.float64)
W_Q = np.array([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=np.float64)
W_K = np.array([[0, 1, 1, 0], [1, 0, 0, 1]], dtype=np.float64)
W_V = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], dtype=np.float64)

Q, K, V = X @ W_Q.T, X @ W_K.T, X @ W_V.T
print("Q =\n", Q, "\nK =\n", K, "\nV =\n", V)

# %% [markdown]
# Every key is `[1, 1]`, so each query scores all four keys equally: the scores are constant
# along every row, the softmax is uniform, and each output is the plain average of the
# values, `[1, 1]`. We use the unscaled scores $QK^\top$ here (a uniform row stays uniform
# under any scale).


# %%
def softmax(x, axis=-1):
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)


scores = Q @ K.T
weights = softmax(scores)
out = weights @ V
print("scores =\n", scores, "\nweights =\n", weights, "\noutput =\n", out)

assert np.allclose(scores, 2.0)
assert np.allclose(weights, 0.25)
assert np.allclose(out, [[1.0, 1.0]] * 4), out

# %% [markdown]
# The same numbers through the library. `dot_product_attention` takes `q [B, T, N, H]` and
# `k, v [B, S, K, H]` (batch, length, heads, head dim); `scale=1.0` gives the unscaled
# scores, and `return_weights=True` also returns the weights `[B, N, T, S]`.

# %%
as_BTNH = lambda a: jnp.asarray(a, jnp.float32)[None, :, None, :]
out_BTNH, weights_BNTS = ops.dot_product_attention(
    as_BTNH(Q), as_BTNH(K), as_BTNH(V), scale=1.0, return_weights=True
)
print(np.asarray(out_BTNH[0, :, 0]))
assert np.allclose(out_BTNH[0, :, 0], out, atol=1e-6)
assert np.allclose(weights_BNTS[0, 0], weights, atol=1e-6)

# With the default scale 1/sqrt(H) the rows stay uniform, so the output is unchanged.
assert np.allclose(ops.dot_product_attention(as_BTNH(Q), as_BTNH(K), as_BTNH(V)), out_BTNH)
viz.plot_attention(
    weights_BNTS[0], tokens=["x1", "x2", "x3", "x4"], title="worked example", cell_size=0.6
)

# %% [markdown]
# ## 2. Why divide by $\sqrt{d_k}$
#
# Take query and key entries independent with mean 0 and variance 1. Then
# $q \cdot k = \sum_{i=1}^{d_k} q_i k_i$ is a sum of $d_k$ independent terms of variance 1,
# so its variance is $d_k$: the logits spread out as the head grows, and the softmax of
# widely spread logits puts almost all weight on one key (its gradient vanishes).
# Dividing by $\sqrt{d_k}$ brings the variance back to 1 at every width.

# %%
rng = np.random.default_rng(0)
variance, variance_scaled, max_weight, max_weight_scaled = [], [], [], []
for d in HEAD_DIMS:
    q = rng.standard_normal((NUM_SAMPLES, d))
    k = rng.standard_normal((NUM_SAMPLES, d))
    dots = (q * k).sum(-1)
    variance.append(dots.var())
    variance_scaled.append((dots / np.sqrt(d)).var())
    # One query against NUM_KEYS keys: how much weight does the top key get?
    n_q = NUM_SAMPLES // NUM_KEYS
    logits = np.einsum("qd,qsd->qs", q[:n_q], rng.standard_normal((n_q, NUM_KEYS, d)))
    max_weight.append(softmax(logits).max(-1).mean())
    max_weight_scaled.append(softmax(logits / np.sqrt(d)).max(-1).mean())

for d, v, vs, m, ms in zip(
    HEAD_DIMS, variance, variance_scaled, max_weight, max_weight_scaled, strict=True
):
    print(f"d_k={d:5d}  var={v:8.1f}  var/sqrt={vs:5.2f}  max w={m:.3f}  max w/sqrt={ms:.3f}")

# %%
fig = Figure(figsize=(11, 4), layout="constrained")
ax1, ax2 = fig.subplots(1, 2)
ax1.loglog(HEAD_DIMS, variance, "o-", label=r"$q \cdot k$")
ax1.loglog(HEAD_DIMS, variance_scaled, "s-", label=r"$q \cdot k / \sqrt{d_k}$")
ax1.loglog(HEAD_DIMS, HEAD_DIMS, "k:", label="$d_k$")
ax1.set(xlabel="$d_k$", ylabel="variance of the logit", title="logit variance")
ax1.legend()
ax2.semilogx(HEAD_DIMS, max_weight, "o-", label="unscaled")
ax2.semilogx(HEAD_DIMS, max_weight_scaled, "s-", label=r"scaled by $1/\sqrt{d_k}$")
ax2.axhline(1 / NUM_KEYS, color="k", ls=":", label="uniform")
ax2.set(xlabel="$d_k$", ylabel="mean largest weight", title=f"softmax peakiness ({NUM_KEYS} keys)")
ax2.legend()
fig

# %%
ratio = np.asarray(variance) / np.asarray(HEAD_DIMS)
assert np.all(np.abs(ratio - 1.0) < 0.15), ratio  # Var(q.k) = d_k
assert np.all(np.abs(np.asarray(variance_scaled) - 1.0) < 0.15), variance_scaled
assert max_weight[-1] > 0.9, "unscaled logits at large d_k give a near one-hot softmax"
assert max(max_weight_scaled) < 0.5, "scaled logits keep the softmax spread at every width"

# %% [markdown]
# ## 3. Every row of weights is a distribution
#
# The softmax makes each query's weights non-negative and sum to one, whatever the inputs,
# the mask (for rows with at least one allowed key), or the number of heads (here GQA:
# 4 query heads share 2 key/value heads).

# %%
key_q, key_k, key_v = jax.random.split(jax.random.key(0), 3)
B, T, S, N, KV, H = 2, 6, 6, 4, 2, 8
q = jax.random.normal(key_q, (B, T, N, H))
k = jax.random.normal(key_k, (B, S, KV, H))
v = jax.random.normal(key_v, (B, S, KV, H))
checks = {"no mask": None, "causal": ops.causal(T), "window 3": ops.sliding_window(T, window=3)}
for name, mask in checks.items():
    _, w = ops.dot_product_attention(q, k, v, mask=mask, return_weights=True)
    sums = np.asarray(w.sum(-1))
    print(f"{name:9s} row sums in [{sums.min():.6f}, {sums.max():.6f}]")
    assert np.allclose(sums, 1.0, atol=1e-5)
    assert float(w.min()) >= 0.0
    if mask is not None:
        assert float(jnp.where(mask, 0.0, w).max()) == 0.0, "masked keys get exactly zero"

# %% [markdown]
# ## 4. The mask zoo
#
# Masks are boolean, True = may attend, broadcastable to `[B, N, T, S]`. Filled cells below
# are the keys (columns) each query (rows) may read.

# %%
T = 10
lengths = jnp.array([7])  # one row with 7 real tokens and 3 padding positions
segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0]])  # three packed documents, then padding
masks = {
    "causal": ops.causal(T),
    # A key-padding mask is [B, 1, 1, S]: every query sees the same keys.
    "padding (7 real keys)": jnp.broadcast_to(
        ops.padding_from_lengths(k_lengths_B=lengths, S=T), (1, 1, T, T)
    ),
    "causal + padding": ops.combine(
        ops.causal(T), ops.padding_from_lengths(lengths, lengths, T=T, S=T)
    ),
    "sliding window (3)": ops.sliding_window(T, window=3),
    "packed segments": ops.combine(ops.causal(T), ops.segment(segments)),
    "prefix-LM (prefix 4)": ops.prefix_lm(jnp.array([4]), T),
    "cross (6 queries, 8 of 10 keys)": ops.cross(
        ops.lengths_to_valid(jnp.array([6]), 6), ops.lengths_to_valid(jnp.array([8]), T)
    ),
    "decode step at position 6": ops.causal(1, T, offset=6),
}
viz.plot_masks(masks, ncols=4)

# %%
m = {name: np.asarray(mask)[0, 0] for name, mask in masks.items()}
assert (m["causal"] == np.tril(np.ones((T, T), bool))).all()
assert (m["sliding window (3)"].sum(-1) == np.minimum(np.arange(T) + 1, 3)).all()
assert not m["packed segments"][3, :3].any(), "document 2 cannot read document 1"
assert not m["packed segments"][-1].any(), "padding attends to nothing"
assert m["prefix-LM (prefix 4)"][0, :4].all() and not m["prefix-LM (prefix 4)"][4, 5:].any()
assert m["cross (6 queries, 8 of 10 keys)"].shape == (6, T)
assert (m["decode step at position 6"][0] == (np.arange(T) <= 6)).all()
