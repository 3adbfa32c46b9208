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
# # Attention maps
#
# Where does each head look? For a model trained here and for a loaded checkpoint, this
# notebook draws every head's attention weights on a prompt and looks for a
# *previous-token head*: one that mostly attends from each token to the token just before
# it. Its score is the mean weight on the $(i, i-1)$ diagonal
# (`attnlab.viz.previous_token_scores`).
#
# **Data.** It reads `../shared`, the folder beside the checkout that only the maintainers'
# checkouts have (or the folder `$ATTNLAB_SHARED` names): tiny Shakespeare
# (`../shared/data/tinyshakespeare.txt`) for part 1 and the tiny GPT-2 test fixture
# (`../shared/fixtures/hf/gpt2`) for part 2. Without it the notebook still runs top to
# bottom: part 1 trains on the embedded corpus instead, and part 2 is skipped, each with a
# one-line note.

# %%
# %matplotlib inline
import os
import pathlib
import tempfile

import jax
import numpy as np
import treescope
from IPython.display import display

import attnlab
from attnlab import load_pretrained, viz
from attnlab.data import make_task
from attnlab.experiment import load_config
from attnlab.runs import train

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) trains the tiny twin for a few steps.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
STEPS = 10 if TINY else 300
OVERRIDES = [
    f"--config.train.steps={STEPS}",
    f"--config.train.log_every_steps={5 if TINY else 50}",
    f"--config.eval.every_steps={STEPS}",
    f"--config.checkpoint.every_steps={STEPS}",
    "--config.eval.sample_tokens=0",
    "--config.optim.learning_rate=3e-3",
    f"--config.optim.warmup_steps={2 if TINY else 30}",
]
if not TINY:  # two layers of four heads: few enough panels to read
    OVERRIDES += ["--config.model.n_layers=2", "--config.model.n_heads=4"]
PROMPT_CHARS = 40

# %%
ROOT = next(
    p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "experiments").is_dir()
)
SHARED = pathlib.Path(os.environ.get("ATTNLAB_SHARED") or ROOT.parent / "shared")
if not SHARED.is_dir():
    print(f"note: {SHARED} is absent: the embedded corpus, and no pretrained checkpoint")


def shown(chars):
    """Visible labels for characters (newline and space)."""
    return [{"\n": "\\n", " ": "_"}.get(c, c) for c in chars]


# %% [markdown]
# ## 1. A model trained here
#
# A character-level decoder on tiny Shakespeare (the embedded corpus when the file is
# absent), trained briefly with `attnlab.runs.train`.

# %%
spec = str(ROOT / "experiments" / "shakespeare_char.py") + (":tiny" if TINY else "")
cfg = load_config(spec, OVERRIDES)
shakespeare = SHARED / "data" / "tinyshakespeare.txt"
cfg.data.path = str(shakespeare) if shakespeare.is_file() else ""
if not cfg.data.path:
    print(f"note: {shakespeare} is absent; training on the embedded corpus instead")
task = make_task(cfg.data)
cfg.model.vocab_size = task.vocab_size
workdir = pathlib.Path(tempfile.mkdtemp(prefix="attnlab_maps_"))
train(cfg, workdir, progress=False)
run = attnlab.load_run(workdir)
model, task = run.model, run.task

# %% [markdown]
# `model(tokens, return_weights=True)` returns every layer's weights in `ModelOutput.weights`:
# one dict per layer, `{"self": [B, N, T, S]}`. A batch of validation rows gives the scores
# below; the first row is drawn.

# %%
T = min(PROMPT_CHARS, cfg.data.seq_len)
rows_BT = task.eval_batches(8, 1)[0]["inputs"][:, :T]
out = jax.jit(lambda tokens: model(tokens, return_weights=True))(rows_BT)
weights_BLNTS = np.stack([np.asarray(layer["self"]) for layer in out.weights], axis=1)
labels = shown(task.decode(rows_BT[0]))
print(f"weights [B, L, N, T, S] = {weights_BLNTS.shape}")
print(repr(task.decode(rows_BT[0])))

# %% [markdown]
# A printed `[B, L, N, T, S]` array is unreadable; `treescope.render_array` draws the first
# row's weights as one heat map per head (queries down, keys across), with a slider over the
# layers. Hover over a cell for its value.

# %%
treescope.display(
    treescope.render_array(
        weights_BLNTS[0],
        rows=[2],
        columns=[1, 3],
        sliders=[0],
        axis_labels={0: "L", 1: "N", 2: "T (query)", 3: "S (key)"},
    )
)

# %%
for layer in range(weights_BLNTS.shape[1]):
    title = f"layer {layer}"
    fig = viz.plot_attention(weights_BLNTS[0, layer], tokens=labels, title=title, cell_size=0.15)
    display(fig)

# %% [markdown]
# Each head's previous-token score, averaged over the batch. A head that spreads its
# weight uniformly over the past scores $\frac{1}{T-1}\sum_{i=1}^{T-1} \frac{1}{i+1}$.

# %%
scores_LN = viz.previous_token_scores(weights_BLNTS).mean(axis=0)
uniform = np.mean([1 / (i + 1) for i in range(1, T)])
layer, head = np.unravel_index(np.argmax(scores_LN), scores_LN.shape)
print(f"uniform attention would score {uniform:.3f}")
print(f"most previous-token head: layer {layer}, head {head}, score {scores_LN[layer, head]:.3f}")
viz.plot_head_scores(scores_LN, title="mean weight on the previous token", vmax=1.0)

# %%
viz.plot_attention(
    weights_BLNTS[0, layer],
    tokens=labels,
    heads=[head],
    title=f"layer {layer}: the most previous-token head",
    cell_size=0.2,
)

# %%
sums = weights_BLNTS.sum(-1)
assert np.allclose(sums, 1.0, atol=1e-5), "every query's weights are a distribution"
upper = np.triu(np.ones((T, T), bool), k=1)
assert np.abs(weights_BLNTS[..., upper]).max() == 0.0, "causal: nothing from the future"
assert scores_LN.shape == (cfg.model.n_layers, cfg.model.n_heads)
assert np.all((scores_LN >= 0) & (scores_LN <= 1))
if not TINY:
    assert scores_LN[layer, head] > 2 * uniform, "training grows a previous-token head"

# %% [markdown]
# ## 2. A loaded checkpoint
#
# The same pictures for a Hugging Face checkpoint, loaded with `attnlab.load_pretrained`:
# here the tiny GPT-2 test fixture in `../shared/fixtures/hf/gpt2` (random weights, so the
# maps show structure from the random initialisation, not from language). Any local
# checkpoint folder of a supported family works the same way. `Pretrained.attention` returns
# one layer's weights `[B, N, T, S]`.

# %%
gpt2_dir = SHARED / "fixtures" / "hf" / "gpt2"
pretrained = None
if (gpt2_dir / "model.safetensors").is_file():
    pretrained = load_pretrained(gpt2_dir)
    print(pretrained)
else:
    print(f"note: {gpt2_dir} is absent; skipping the pretrained checkpoint part")

# %%
if pretrained is not None:
    ids_1T = np.load(gpt2_dir / "reference.npz")["input_ids"][:1]  # 24 random token ids
    n_layers, n = pretrained.config.n_layers, ids_1T.shape[1]
    hf_LNTS = np.stack([pretrained.attention(ids_1T, layer=i)[0] for i in range(n_layers)])
    for i in range(n_layers):
        title = f"gpt2 fixture, layer {i}"
        display(viz.plot_attention(hf_LNTS[i], tokens=ids_1T[0], title=title, ncols=2))

# %%
if pretrained is not None:
    hf_scores_LN = viz.previous_token_scores(hf_LNTS)
    i, h = np.unravel_index(np.argmax(hf_scores_LN), hf_scores_LN.shape)
    print(f"most previous-token head: layer {i}, head {h}, score {hf_scores_LN[i, h]:.3f}")
    display(viz.plot_head_scores(hf_scores_LN, title="gpt2 fixture: previous token", vmax=1.0))
    assert hf_LNTS.shape == (n_layers, pretrained.config.n_heads, n, n)
    assert np.allclose(hf_LNTS.sum(-1), 1.0, atol=1e-5)
    assert np.abs(hf_LNTS[..., np.triu(np.ones((n, n), bool), k=1)]).max() == 0.0
