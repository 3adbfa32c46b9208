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
# # Attention transfer: linearizing a trained decoder with distillation and LoRA
#
# LoLCATs (Zhang et al. 2024) turns a pretrained Transformer into a subquadratic one in two
# cheap stages. **Stage 1, attention transfer**: the teacher is frozen and only the new
# layers' few parameters (feature maps) train, so that each layer's output matches softmax
# attention's under MSE. **Stage 2**: LoRA adapters with next-token loss. The new layer is
# softmax over a short sliding window plus linear attention over everything older.
#
# This notebook trains a character-level teacher, exports it as a Hugging Face folder and
# loads it back (the path a real model takes), runs both stages with
# `experiments/attention_transfer.py`'s config, and compares teacher and student.

# %%
# %matplotlib inline
import json
import os
import pathlib
import tempfile

import numpy as np
from matplotlib.figure import Figure

import attnlab
from attnlab import experiment
from attnlab.runs.export import export_run
from attnlab.runs.loop import train
from attnlab.transfer import pipeline

attnlab.compilation_cache()

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) trains a tiny teacher and the :tiny stages.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
REPO = pathlib.Path.cwd().parent if pathlib.Path.cwd().name == "notebooks" else pathlib.Path.cwd()
WORK = pathlib.Path(tempfile.mkdtemp(prefix="attention_transfer_"))

# %% [markdown]
# ## The teacher
#
# The README's main experiment: a 4-layer decoder on the standard library's source (600
# steps, about 0.9M parameters), written out as a Hugging Face folder with its tokenizer.

# %%
teacher_run = WORK / "teacher"
char_lm = str(REPO / "experiments" / "char_lm.py") + (":tiny" if TINY else "")
tcfg = experiment.load_config(char_lm, ["--config.model.n_layers=2"] if TINY else [])
record = train(tcfg, teacher_run, progress=False)
hf_dir = WORK / "teacher_hf"
export_run(teacher_run, hf_dir)
(hf_dir / "tokenizer.json").write_text((teacher_run / "tokenizer.json").read_text())
print(record.get("eval_loss"), sorted(p.name for p in hf_dir.iterdir()))

# %% [markdown]
# ## Both stages
#
# Every layer gets `lolcats` (a window of 32 tokens of softmax attention plus linear
# attention with learned Hedgehog feature maps), initialised from the teacher's q, k, v and
# o (`init="matching"`: the new layer keeps attention's parameter names). Stage 1 trains
# only the feature maps and the mixing factor; stage 2 trains rank-8 LoRA adapters on q,
# k, v and o. The swap baseline is LoLCATs' "swap & finetune": the layer without its window
# (`transfer.swap_settings='{"window": 0}'`), no stage 1, the adapters alone for the same
# tokens.

# %%
spec = str(REPO / "experiments" / "attention_transfer.py") + (":tiny" if TINY else "")
cfg = experiment.load_config(spec, [f"--config.transfer.teacher={hf_dir}"])
results = pipeline.run(cfg, WORK / "transfer")
keys = ("teacher_eval_loss", "student_eval_loss", "swap_only_eval_loss", "trainable_fraction")
print(json.dumps({k: results[k] for k in keys}, indent=1))

# %% [markdown]
# ## Stage 1, layer by layer
#
# Each replaced layer's attention-output MSE against the teacher's, the student's layer fed
# the teacher's layer input (`attnlab.train.distill`).

# %%
rows = [
    json.loads(x) for x in (WORK / "transfer" / "stage1" / "metrics.jsonl").read_text().splitlines()
]
fig = Figure(figsize=(5, 3))
ax = fig.subplots()
for j, layer in enumerate(sorted(results["layers"], key=int)):
    ax.plot(
        [r["step"] for r in rows], [r["attention_mse"][j] for r in rows], label=f"layer {layer}"
    )
ax.set(yscale="log", xlabel="stage-1 step", ylabel="attention MSE")
ax.legend()
fig

# %%
for layer in sorted(results["layers"], key=int):
    start, end = results["attention_mse_start"][layer], results["attention_mse_end"][layer]
    print(f"layer {layer}: {start:.4g} -> {end:.4g} ({start / max(end, 1e-30):.1f}x lower)")

# %% [markdown]
# ## What the student keeps and what it saves
#
# Its decode state is a window and a fixed linear state, so its cache stops growing with
# the context; the teacher's keys and values grow with every token.

# %%
for who in ("teacher", "student"):
    for length, d in results["decode"][who].items():
        print(
            f"{who:8s} L={int(length):>6}: cache {d['cache_bytes']:>11,} B, "
            f"decode step {1e3 * d['step_seconds']:.2f} ms"
        )
print("passkey digits:", results["passkey"])
print(
    f"adapters: {results['lora_bytes']:,} bytes on disk, "
    f"{100 * results['trainable_fraction']:.1f}% of the model's parameters"
)
np.isfinite(results["student_eval_loss"])
