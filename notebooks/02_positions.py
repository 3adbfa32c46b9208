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
# # Positions
#
# Attention by itself sees a *set* of tokens: permute the input and the output is permuted
# the same way. Word order enters only through position information. This notebook draws
# the sinusoidal table, checks permutation equivariance without positions and its loss with
# sinusoidal positions or RoPE, and checks RoPE's defining property: the score of a query at
# position $m$ and a key at position $n$ depends only on $m - n$.

# %%
# %matplotlib inline
import os

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

import attnlab
from attnlab import ModelConfig, build_model, ops, viz

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) shrinks the models and tables.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
NUM_POSITIONS = 64 if TINY else 128
D_MODEL = 32 if TINY else 64
N_LAYERS = 1 if TINY else 2
SEQ_LEN = 12 if TINY else 24

# %% [markdown]
# ## 1. The sinusoidal table
#
# $PE(p, 2i) = \sin(p / 10000^{2i/d})$ and $PE(p, 2i+1) = \cos(p / 10000^{2i/d})$: each pair
# of dimensions is a clock turning at its own speed, fast on the left, slow on the right.

# %%
table = np.asarray(ops.sinusoidal(NUM_POSITIONS, D_MODEL))
viz.plot_position_table(table, title=f"sinusoidal positions, d = {D_MODEL}")

# %% [markdown]
# Dot products between position vectors depend only on the offset between the positions,
# and mostly fall off with it: the bands run parallel to the diagonal. Since
# $\sin(a)\sin(b) + \cos(a)\cos(b) = \cos(a - b)$, each sin/cos pair contributes
# $\cos((m - n)\,\omega_i)$, exactly a function of $m - n$.

# %%
similarity = table @ table.T
fig = Figure(figsize=(5, 4.2), layout="constrained")
ax = fig.add_subplot()
image = ax.imshow(similarity, cmap="viridis")
ax.set(xlabel="position n", ylabel="position m", title="PE(m) . PE(n)")
fig.colorbar(image, ax=ax)
fig

# %%
offsets = np.subtract.outer(np.arange(NUM_POSITIONS), np.arange(NUM_POSITIONS))
for d in range(1 - NUM_POSITIONS, NUM_POSITIONS):
    values = similarity[offsets == d]
    assert np.allclose(values, values[0], atol=1e-4), d
assert np.allclose(np.diag(similarity), D_MODEL / 2)  # each sin/cos pair has norm 1

# %% [markdown]
# ## 2. Permutation equivariance without positions
#
# An encoder (bidirectional attention, no mask) with `position="none"`: permuting the input
# tokens permutes the output logits in exactly the same way. Each token's output depends on
# *which* tokens are present, never on where they are.


# %%
def encoder(position):
    # A larger init than the default makes attention far from uniform, so any position
    # signal shows clearly in the outputs.
    cfg = ModelConfig(
        arch="encoder",
        vocab_size=50,
        d_model=D_MODEL,
        n_layers=N_LAYERS,
        n_heads=4,
        max_len=NUM_POSITIONS,
        position=position,
        init_std=0.2,
    )
    return build_model(cfg, seed=0)


tokens_BT = jax.random.randint(jax.random.key(1), (1, SEQ_LEN), 3, 50)
perm = np.random.default_rng(0).permutation(SEQ_LEN)


def equivariance_gap(model):
    """max |f(permuted x) - permuted f(x)| over all logits."""
    logits = model(tokens_BT).logits
    logits_of_permuted = model(tokens_BT[:, perm]).logits
    return float(jnp.abs(logits_of_permuted - logits[:, perm]).max())


gaps = {
    position: equivariance_gap(encoder(position)) for position in ("none", "sinusoidal", "rope")
}
for position, gap in gaps.items():
    print(f"position={position:10s}  max |f(Px) - P f(x)| = {gap:.2e}")

# %%
fig = Figure(figsize=(6, 3.2), layout="constrained")
ax = fig.add_subplot()
ax.bar(list(gaps), [max(g, 1e-9) for g in gaps.values()], color=["C2", "C0", "C1"])
ax.set_yscale("log")
ax.set(ylabel="max |f(Px) - P f(x)|", title="permutation equivariance gap (log scale)")
ax.axhline(1e-5, color="k", ls=":", label="float32 noise")
ax.legend()
fig

# %%
assert gaps["none"] < 1e-5, "no positions: a permuted input gives the permuted output"
assert gaps["sinusoidal"] > 1e-2, "sinusoidal positions break equivariance"
assert gaps["rope"] > 1e-2, "RoPE breaks equivariance"

# %% [markdown]
# ## 3. RoPE depends only on relative position
#
# RoPE rotates each pair of query/key dimensions by an angle proportional to the position.
# Rotations preserve dot products up to the *difference* of the angles, so
# $\langle R_m q, R_n k\rangle = \langle q, R_{n-m} k\rangle$: the score depends on $m - n$
# only. Take one fixed query vector and one fixed key vector, place them at every pair of
# positions, and look at the score matrix: it is constant along every diagonal.

# %%
H = 16
q_H, k_H = jax.random.normal(jax.random.key(2), (2, H))
positions_BT = jnp.arange(NUM_POSITIONS)[None, :]
q_BTNH = ops.apply_rope(jnp.broadcast_to(q_H, (1, NUM_POSITIONS, 1, H)), positions_BT)
k_BTNH = ops.apply_rope(jnp.broadcast_to(k_H, (1, NUM_POSITIONS, 1, H)), positions_BT)
scores_MN = np.asarray(jnp.einsum("mh,nh->mn", q_BTNH[0, :, 0], k_BTNH[0, :, 0]))

fig = Figure(figsize=(11, 4), layout="constrained")
ax1, ax2 = fig.subplots(1, 2)
limit = np.abs(scores_MN).max()
image = ax1.imshow(scores_MN, cmap="RdBu_r", vmin=-limit, vmax=limit)
ax1.set(xlabel="key position n", ylabel="query position m", title="RoPE score q(m) . k(n)")
fig.colorbar(image, ax=ax1)
d_range = np.arange(-(NUM_POSITIONS - 1), NUM_POSITIONS)
by_offset = [scores_MN[offsets == d].mean() for d in d_range]
ax2.plot(d_range, by_offset)
ax2.set(xlabel="m - n", ylabel="score", title="the score as a function of m - n")
fig

# %%
scale = np.abs(scores_MN).max()
spread = max(np.ptp(scores_MN[offsets == d]) for d in d_range)
print(f"largest spread along a diagonal: {spread:.1e} (scores up to {scale:.2f})")
assert spread <= 1e-4 * scale  # float32 rounding of the rotation angles only
# Shifting both positions by the same amount leaves the score unchanged...
shift = NUM_POSITIONS // 3
assert np.allclose(scores_MN[:-shift, :-shift], scores_MN[shift:, shift:], atol=1e-4)
# ...while the score does change with the distance.
assert np.ptp(by_offset) > 0.1 * scale

# %% [markdown]
# The same holds inside the library's attention: with RoPE, shifting all positions of a
# sequence by a constant leaves the attention weights unchanged.

# %%
q_seq_BTNH, k_seq_BTNH = jax.random.normal(jax.random.key(3), (2, 1, SEQ_LEN, 2, H))


@jax.jit
def rope_attention_weights(start):
    """Causal self-attention weights with every position shifted by ``start``."""
    pos_BT = start + jnp.arange(SEQ_LEN)[None, :]
    q, k = ops.apply_rope(q_seq_BTNH, pos_BT), ops.apply_rope(k_seq_BTNH, pos_BT)
    _, weights_BNTS = ops.dot_product_attention(
        q, k, k, mask=ops.causal(SEQ_LEN), return_weights=True
    )
    return weights_BNTS


weights = {start: rope_attention_weights(start) for start in (0, 17)}
gap = float(jnp.abs(weights[0] - weights[17]).max())
print(f"max weight change after shifting every position by 17: {gap:.1e}")
assert gap < 1e-5
viz.plot_attention(weights[0][0], title="RoPE attention, positions 0.. and 17.. (identical)")
