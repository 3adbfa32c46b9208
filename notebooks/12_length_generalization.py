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
# # Length generalisation and long context
#
# Two questions are asked of any new attention variant or position encoding: how does it
# behave beyond the length it trained at, and can it find and use information far back?
# This notebook asks both of small decoders trained here:
#
# 1. loss by evaluation length (`attnlab.evaluation.length`, the engine of `attnlab eval
#    --lengths`), for ALiBi against RoPE trained at the same length, and RoPE again with
#    YaRN applied at evaluation time;
# 2. RULER-style tasks (`attnlab.data.ruler_tasks`): what an example looks like, and how a
#    model is scored on them by length (`attnlab eval --tasks`);
# 3. the algorithmic tasks of NoPE's experiment (`data.kind="length_task"`), the rows a model
#    trains on at short lengths.
#
# `experiments/length_positions.py`, `length_nope.py` and `length_ruler.py` run the full
# versions; docs/length.md has their figures.

# %%
# %matplotlib inline
import os
import pathlib
import tempfile

import numpy as np
from IPython.display import Image, display

import attnlab
from attnlab import experiment, runs
from attnlab.data import length_tasks, make_task, ruler_tasks
from attnlab.data.tokenizers import ByteTokenizer
from attnlab.evaluation import length, ruler

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) trains for two steps: the cells check that the
# tools run, not the findings.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
STEPS = 2 if TINY else 300
TRAIN_LEN = 16 if TINY else 128
LENGTHS = [TRAIN_LEN * k for k in (1, 2, 4)] if TINY else [TRAIN_LEN * k for k in (1, 2, 4, 8)]
TOKENS = 64 if TINY else 8192

# %% [markdown]
# ## Train short
#
# The decoder of `experiments/length_positions.py` (its tiny twin under the test suite),
# trained on the embedded corpus (the Python standard library's source) at `TRAIN_LEN`
# characters, once with ALiBi and once with RoPE.

# %%
ROOT = pathlib.Path(tempfile.mkdtemp(prefix="length_"))
SPEC = str(pathlib.Path("..") / "experiments" / "length_positions.py")
if not pathlib.Path(SPEC).is_file():  # run from the repository root
    SPEC = str(pathlib.Path("experiments") / "length_positions.py")
RUNS = {}
for position in ("alibi", "rope"):
    overrides = [f"--config.model.position={position}", f"--config.train.steps={STEPS}"]
    overrides += [f"--config.eval.every_steps={STEPS}", f"--config.checkpoint.every_steps={STEPS}"]
    cfg = experiment.load_config(f"{SPEC}:tiny" if TINY else SPEC, overrides)
    RUNS[position] = ROOT / position
    runs.train(cfg, RUNS[position], progress=False)

# %% [markdown]
# ## Test long
#
# `evaluate_lengths` scores non-overlapping windows of each length (`chunks`), each window
# run through the KV cache in prefill chunks, so memory grows linearly with the length. A
# learned position table would refuse any length past its rows in one line, before any
# compute; ALiBi and RoPE extend to any length. `rope_scaling="yarn:8"` stretches RoPE at
# evaluation time, its original length the training length.

# %%
results = {}
for name, workdir in RUNS.items():
    results[name] = length.evaluate_lengths(
        length.from_workdir(workdir), LENGTHS, tokens=TOKENS, chunk=64
    )
results["rope + yarn:8"] = length.evaluate_lengths(
    length.from_workdir(RUNS["rope"], rope_scaling="yarn:8"), LENGTHS, tokens=TOKENS, chunk=64
)
print(length.markdown_table(results, ("chunks",)))
display(Image(str(length.plot_lengths(results, "chunks", ROOT / "length.png"))))

# %% [markdown]
# ## RULER-style tasks
#
# Each task is drawn by seed from any text and any tokenizer; the prompt ends with an answer
# prefix, so the answer is the continuation. Here, a single needle in noise at 256 bytes:

# %%
tok = ByteTokenizer()


def encode(text):
    return [int(i) for i in tok.encode(text)]


example = ruler_tasks.examples("niah_single", 256, 1, encode, seed=0)[0]
print(tok.decode(np.asarray(example.prompt)) + "|" + tok.decode(np.asarray(example.target)))
print("references:", example.references)

# %% [markdown]
# A model is scored by greedy decoding through the cache, the output cut at its first
# newline and counted by the fraction of references it holds. The runs above never saw the
# tasks, so they score near zero; `experiments/length_ruler.py` trains on them first (the
# `length_task` data kind) and compares mixers by their effective length.

# %%
scored = ruler.evaluate_tasks(
    length.from_workdir(RUNS["alibi"]), "passkey", [TRAIN_LEN * 8, TRAIN_LEN * 16], examples=2
)
print(scored["accuracy"], "effective length:", scored["effective_length"])
display(Image(str(ruler.plot_heatmap(scored, ROOT / "tasks.png", title="alibi, untrained"))))

# %% [markdown]
# ## Algorithmic tasks
#
# NoPE's tasks as rows a decoder trains on: `BOS marker problem SEP answer EOS`, the loss on
# the answer. Training draws problem lengths up to `max_len`; testing asks for longer ones.

# %%
task = make_task({"kind": "length_task", "tasks": "copy,reverse,addition,parity",
                  "seq_len": 40, "num_symbols": 8, "min_len": 1, "max_len": 8})  # fmt: skip
batch = task.train_batch(0, 0, 4)
for row in range(4):
    print(task.describe(batch, row).replace("\n", "   "))
print("vocabulary:", length_tasks.vocab_size(8), "ids")
