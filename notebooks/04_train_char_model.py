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
# # Train a character-level model
#
# A small decoder-only transformer trained on tiny Shakespeare with `attnlab.runs.train`, the same
# loop the `attnlab train` command runs: the experiment config
# `experiments/shakespeare_char.py`, a short budget, the loss curves, and samples.
#
# The text is read from `../shared/data/tinyshakespeare.txt` beside the checkout. Where that
# file is absent, the notebook falls back to the embedded corpus (the Python standard
# library's source), so it runs anywhere.

# %%
# %matplotlib inline
import math
import os
import pathlib
import tempfile

import numpy as np
import treescope
from flax import nnx

import attnlab
from attnlab import viz
from attnlab.data import make_task
from attnlab.decode import generate
from attnlab.experiment import load_config
from attnlab.runs import train

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) trains the experiment's tiny twin for a few steps.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
STEPS = 20 if TINY else 500
OVERRIDES = [
    f"--config.train.steps={STEPS}",
    f"--config.train.log_every_steps={2 if TINY else 50}",
    f"--config.eval.every_steps={10 if TINY else 100}",
    "--config.eval.batches=2" if TINY else "--config.eval.batches=10",
    "--config.optim.learning_rate=3e-3",
    f"--config.optim.warmup_steps={5 if TINY else 50}",
    f"--config.checkpoint.every_steps={STEPS}",
]

# %%
ROOT = next(
    p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "experiments").is_dir()
)
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"

spec = str(ROOT / "experiments" / "shakespeare_char.py") + (":tiny" if TINY else "")
cfg = load_config(spec, OVERRIDES)
if SHAKESPEARE.is_file():
    cfg.data.path = str(SHAKESPEARE)
    PROMPTS = ["ROMEO:", "JULIET:", "MENENIUS:"]
else:
    print(f"note: {SHAKESPEARE} is absent; training on the embedded corpus instead")
    cfg.data.path = ""
    PROMPTS = ["def ", "class ", "import "]

# A character tokenizer's vocabulary comes from the text itself: size the model to it.
task = make_task(cfg.data)
cfg.model.vocab_size = task.vocab_size
print(f"vocabulary: {task.vocab_size} characters")
print(
    f"model: {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, context {cfg.data.seq_len}"
)

# %% [markdown]
# ## Train
#
# `train(cfg, workdir)` writes `metrics.jsonl`, `samples.jsonl`, the resolved `config.json`
# and checkpoints into the work directory (a temporary one here).

# %%
workdir = pathlib.Path(tempfile.mkdtemp(prefix="attnlab_char_"))
final = train(cfg, workdir, progress=False)
print(final)

# %%
corpus = "tiny Shakespeare" if cfg.data.path else "the embedded corpus"
viz.plot_loss_curves(workdir, labels=[cfg.name], title=f"character model on {corpus}")

# %%
records = viz.read_metrics(workdir)
train_losses = [r["train_loss"] for r in records if "train_loss" in r]
eval_losses = [r["eval_loss"] for r in records if "eval_loss" in r]
uniform = math.log(task.vocab_size)  # the loss of a model that knows nothing
print(f"uniform guess: {uniform:.2f} nats/char")
print(
    f"train loss: {train_losses[0]:.2f} -> {train_losses[-1]:.2f}; last eval {eval_losses[-1]:.2f}"
)
assert all(math.isfinite(x) for x in train_losses + eval_losses)
assert final["step"] == STEPS
if not TINY:
    assert eval_losses[-1] < uniform - 1.5, "the model has learned character statistics"
    assert train_losses[-1] < uniform - 1.5

# %% [markdown]
# ## Samples
#
# During training, each evaluation logged a sample (`samples.jsonl`).

# %%
for record in viz.read_samples(workdir):
    print(f"--- step {record['step']} ---\n{record['text']}\n")

# %% [markdown]
# The trained model, reloaded from its last checkpoint, continues a few prompts at
# temperature 0.8 (`attnlab.decode.generate` with a KV cache). The context is
# `run.model_config.max_len` characters (the typed `ModelConfig`), so each continuation fills
# what is left of it.

# %%
# `load_run` gives the run as a `Run`: its config, model, tokenizer, step and metrics rows.
run = attnlab.load_run(workdir)
model, task = run.model, run.task
print(f"step {run.step}, final eval loss {run.metrics[-1].get('eval_loss')}")
prompts = [task.encode(p) for p in PROMPTS]
new_tokens = run.model_config.max_len - max(len(p) for p in prompts)
result = generate(model, prompts, new_tokens, temperature=0.8, seed=0)
samples = [text + task.decode(result.tokens[b]) for b, text in enumerate(PROMPTS)]
for text in samples:
    print(text, "\n" + "-" * 40)

# %%
assert run.step == STEPS
assert result.tokens.shape == (len(PROMPTS), new_tokens)
assert np.all((result.tokens >= 0) & (result.tokens < task.vocab_size))
assert all(
    s.startswith(p) and len(s) == len(p) + new_tokens for s, p in zip(samples, PROMPTS, strict=True)
)

# %% [markdown]
# The trained parameters as one tree (`nnx.state`), drawn by `treescope`: each leaf is named
# by its shape's letters and summarised (mean, standard deviation, range); click a node to
# unfold it. This experiment unrolls its layers (`scan_layers=False`, faster at this width),
# so each block has its own subtree; a scanned stack (the default) holds one subtree whose
# leaves share a leading `L` axis.

# %%
treescope.display(nnx.state(model, nnx.Param))
