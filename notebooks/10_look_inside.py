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
# # Look inside
#
# Every intermediate of an attnlab model has a stable name (`layers.1.attn.z`,
# `layers.0.resid_post`, ...), and `attnlab.inspect` captures or patches any of them in a
# jitted forward pass. This notebook trains a two-layer, attention-only model to copy a
# sequence of random tokens, a task solved by an *induction head* (Olsson et al. 2022: a
# layer-1 head that attends to the token after the previous occurrence of the current
# token, with help from a layer-0 previous-token head), then
#
# 1. finds the head by activation patching (clean run -> corrupted run, head by head),
# 2. ablates it and watches in-context copying fail,
# 3. reads each layer's residual stream through the unembedding (the logit lens),
# 4. and trains the same model at a learning rate high enough to break it, with and without
#    QK-norm, watching the gradient norm and the largest pre-softmax attention logit, the
#    latter captured from `layers.*.attn.scores` inside the training step.

# %%
# %matplotlib inline
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from IPython.display import display
from matplotlib.figure import Figure

import attnlab
from attnlab import inspect as ins
from attnlab import viz
from attnlab.data import synthetic

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) trains for a few steps only: the induction head
# then has not formed, and the cells check shapes, not findings.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
STEPS = 30 if TINY else 600
HEALTH_STEPS = 15 if TINY else 200
BATCH = 16 if TINY else 32
SYMBOLS, SEQ_LEN, MIN_LEN, MAX_LEN = 24, 32, 4, 14
SHOW_LEN = 12  # the copied length of the rows we look at

# %% [markdown]
# ## 1. Train an attention-only model to copy
#
# `synthetic.copy_batch` draws rows `BOS x1 .. xn SEP x1 .. xn EOS` with the loss on the
# copy. Lengths vary (4 to 14), so no fixed positional offset finds the token to copy: the
# model has to look up where the current token occurred before and read the next one.
# Two layers of four heads, RoPE, no FFN (`ffn_variant="none"`).

# %%
cfg = attnlab.ModelConfig(
    vocab_size=synthetic.symbols_vocab_size(SYMBOLS),
    d_model=64,
    n_heads=4,
    n_layers=2,
    ffn_variant="none",
    position="rope",
    max_len=SEQ_LEN,
)


def batch(rng, n=BATCH, lo=MIN_LEN, hi=MAX_LEN):
    rows = synthetic.copy_batch(rng, n, SEQ_LEN, num_symbols=SYMBOLS, min_len=lo, max_len=hi)
    return {k: jnp.asarray(v) for k, v in rows.items()}


def copy_loss(logits_BTV, b):
    """(mean cross-entropy, accuracy) on the copied tokens."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, b["targets"])
    m = b["loss_mask"]
    right = (jnp.argmax(logits_BTV, -1) == b["targets"]) * m
    return jnp.sum(ce * m) / jnp.sum(m), jnp.sum(right) / jnp.sum(m)


def trainer(cfg, *, capture=("layers.*.attn.scores",)):
    """A jitted Adam step (the learning rate an argument) over the model split once; each
    step reports the largest finite value of the intermediates ``capture`` names (through an
    ``attnlab.inspect.Probe`` inside the step)."""
    graphdef, params = nnx.split(attnlab.build_model(cfg, seed=0))
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)

    def loss_fn(params, b):
        with ins.Probe(capture) as probe:
            logits = nnx.merge(graphdef, params)(b["inputs"]).logits
        loss, acc = copy_loss(logits, b)
        peak = [jnp.max(jnp.where(jnp.isfinite(v), v, -jnp.inf)) for v in probe.captured.values()]
        return loss, (acc, jnp.max(jnp.stack(peak)))

    @jax.jit
    def step(params, opt_state, b, learning_rate):
        opt_state.hyperparams["learning_rate"] = learning_rate
        (loss, (acc, peak)), g = jax.value_and_grad(loss_fn, has_aux=True)(params, b)
        updates, opt_state = opt.update(g, opt_state, params)
        stats = {"loss": loss, "accuracy": acc, "grad_norm": optax.global_norm(g), "peak": peak}
        return optax.apply_updates(params, updates), opt_state, stats

    return graphdef, params, opt.init(params), step


rng = np.random.default_rng(0)
graphdef, params0, opt_state0, step = trainer(cfg)
params, opt_state = params0, opt_state0
for i in range(STEPS):
    params, opt_state, stats = step(params, opt_state, batch(rng), 3e-3)
    if i % max(1, STEPS // 6) == 0 or i == STEPS - 1:
        print(f"step {i:4d}  loss {stats['loss']:.3f}  copy accuracy {stats['accuracy']:.2f}")
model = nnx.merge(graphdef, params)

# %% [markdown]
# ## 2. Where the heads look
#
# `ins.names(model, tokens)` lists every named intermediate with its shape; `ins.run`
# captures the selected ones. Rows of one length (`SHOW_LEN`) put the copy at the same
# place in every row. A head that copies reads the first half: the share of each head's
# attention that the copy's queries put on the first `n` tokens says which heads do.

# %%
n = SHOW_LEN
show = batch(np.random.default_rng(1), 8, n, n)
T = 2 * n + 2  # BOS x1..xn SEP x1..xn
clean_BT, targets_BT = show["inputs"][:, :T], show["targets"][:, :T]
named = ins.names(model, clean_BT)
print(len(named), "named intermediates, e.g.")
for name in ("layers.0.resid_pre", "layers.1.attn.q", "layers.1.attn.weights", "layers.1.attn.z"):
    print(f"  {name:24s} {named[name].shape}  patchable={named[name].patchable}")

out, acts = ins.run(model, clean_BT, capture=["layers.*.attn.weights"])
weights_LBNTS = np.asarray(acts.stack("attn.weights"))
first_half_LN = weights_LBNTS[:, :, :, n + 1 : 2 * n + 1, 1 : n + 1].sum(-1).mean(axis=(1, 3))
display(viz.plot_head_scores(first_half_LN, title="attention of the copy on the first half"))
labels = [str(int(t)) for t in clean_BT[0]]
display(viz.plot_attention(weights_LBNTS[1, 0], tokens=labels, title="layer 1", cell_size=0.12))

# %% [markdown]
# ## 3. Find the induction head by patching
#
# The corrupted rows keep the copy half but re-draw the first half, so the model copies the
# wrong tokens. The metric is the mean log-probability of the clean next token over the
# copy. `ins.patching_sweep(..., name="attn.z", by="head")` runs the corrupted rows once per
# (layer, head) with that head's output replaced by its clean value (one batched, compiled
# program) and reports the share of the clean metric each patch restores.

# %%
first = np.random.default_rng(2).integers(synthetic.NUM_SPECIAL, synthetic.NUM_SPECIAL + SYMBOLS,
                                          (clean_BT.shape[0], n))  # fmt: skip
corrupted_BT = clean_BT.at[:, 1 : n + 1].set(jnp.asarray(first, clean_BT.dtype))
copy_mask_BT = jnp.zeros(clean_BT.shape, bool).at[:, n + 1 : 2 * n + 1].set(True)


def clean_logprob(logits_BTV):
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    picked_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(copy_mask_BT, picked_BT, 0.0)) / jnp.sum(copy_mask_BT)


table = ins.patching_sweep(model, clean_BT, corrupted_BT, clean_logprob, name="attn.z", by="head")
print(f"clean {table.clean:.2f}, corrupted {table.corrupted:.2f} (mean log-prob of the copy)")
display(table.plot(title="patching each head's output (attn.z), clean -> corrupted"))
layer, head = table.best()
print(f"the head that restores most: layer {layer}, head {head}")
assert table.values.shape == (cfg.n_layers, cfg.n_heads)

# %% [markdown]
# ## 4. Ablate it
#
# `ins.zero("layers.L.attn.z", heads=h)` zeroes one head's output (the same as zeroing its
# rows of the output projection; `ins.mean_ablate` would replace it by its mean). Copy
# accuracy on fresh rows with the best head zeroed, then with the heads the sweep ranks
# highest zeroed together: a model with four heads a layer may spread the copying over
# several heads, and then only their joint ablation stops it.


# %%
def copy_accuracy(patches=()):
    b = batch(np.random.default_rng(3), 64)
    logits, _ = ins.run(model, b["inputs"], patches=patches)
    return float(copy_loss(logits.logits, b)[1])


def zeroed(cells):
    """Patches zeroing the heads of ``cells`` ((layer, head) pairs): one per layer, its head
    indices padded with -1 (no head), so every set of cells runs the same compiled program."""
    heads = np.full((cfg.n_layers, cfg.n_heads), -1)
    for layer_i, head_i in cells:
        heads[layer_i, head_i] = head_i
    return [ins.zero(f"layers.{i}.attn.z", heads=heads[i]) for i in range(cfg.n_layers)]


base_acc = copy_accuracy(zeroed([]))
share_LN = table.normalized()
ranked = sorted(np.ndindex(share_LN.shape), key=lambda c: -share_LN[c])
print(f"no ablation: copy accuracy {base_acc:.2f}")
print(f"layer {layer} head {head} zeroed: {copy_accuracy(zeroed([(layer, head)])):.2f}")
found = [c for c in ranked if share_LN[c] > 0.3] or ranked[:1]
curve = {k: copy_accuracy(zeroed(ranked[:k])) for k in range(1, len(found) + 1)}
for k, acc in curve.items():
    print(f"top {k} heads by patching {ranked[:k]} zeroed: {acc:.2f}")
if not TINY:
    assert curve[len(found)] < base_acc - 0.3, "without the heads patching found, copying fails"

# %% [markdown]
# ## 5. The logit lens
#
# `ins.logit_lens` reads each layer's residual stream (`resid_post`) through the final norm
# and the unembedding. After layer 0 the model cannot yet say which token comes next in the
# copy; after layer 1 (the model's own output) it can.

# %%
lens_LBTV, logits_BTV = ins.logit_lens(model, clean_BT)
for i in range(cfg.n_layers):
    print(f"after layer {i}: mean log-prob of the next copy {clean_logprob(lens_LBTV[i]):.2f}")
np.testing.assert_allclose(lens_LBTV[-1], logits_BTV, rtol=1e-5, atol=1e-5)

# %% [markdown]
# ## 6. Pushed to instability, with and without QK-norm
#
# The same model trained at a learning rate ten times too high. Each step reports the
# gradient norm and the largest pre-softmax attention logit, captured from
# `layers.*.attn.scores` by a `Probe` inside the jitted training step (masked keys are
# `-inf` there and are skipped). Large-logit growth is the instability that QK-norm (RMS
# normalisation of q and k per head, `ModelConfig.qk_norm=True`) is meant to prevent
# (Dehghani et al. 2023, Wortsman et al. 2024).

# %%
curves = {}
arms = {
    "plain": (params0, opt_state0, step),  # section 1's compiled step, from the same weights
    "QK-norm": trainer(dataclasses.replace(cfg, qk_norm=True))[1:],
}
for name, (p, o, unstable_step) in arms.items():
    rng = np.random.default_rng(4)
    rows = []
    for _ in range(HEALTH_STEPS):
        p, o, stats = unstable_step(p, o, batch(rng), 3e-2)
        rows.append({k: float(v) for k, v in stats.items()})
    curves[name] = rows
    last = rows[-1]
    print(f"{name:8s} loss {last['loss']:.3f}  grad norm {last['grad_norm']:.2f}  "
          f"largest logit {max(r['peak'] for r in rows):.1f}")  # fmt: skip

fig = Figure(figsize=(11, 3), layout="constrained")
for ax, key in zip(fig.subplots(1, 3), ("loss", "grad_norm", "peak"), strict=True):
    for name, rows in curves.items():
        ax.plot([r[key] for r in rows], label=name)
    ax.set_title({"peak": "largest pre-softmax logit"}.get(key, key))
    ax.set_xlabel("step")
    ax.set_yscale("log" if key != "loss" else "linear")
    ax.legend()
display(fig)
assert all(np.isfinite(r["peak"]) for r in curves["QK-norm"])
