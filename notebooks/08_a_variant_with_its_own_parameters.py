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
# # A variant with its own parameters
#
# Notebook 07 changed the score function alone. Most attention ideas need more: a parameter,
# a projection, another cache entry. A variant is then a small Flax NNX module, registered
# by name (`attnlab.register_mixer`), that the library builds in every self-attention layer
# of `ModelConfig(mixer=name)`: no library file changes (docs/variants.md has the contract).
#
# The variant here, **null-key attention with a learned temperature**, adds two parameters
# per layer to softmax attention:
#
# * a learned key $n_h$ per head with a zero value, which joins every query's softmax, so a
#   head can put its weight "nowhere" instead of on some token;
# * a learned temperature $\tau_h = e^{\theta_h}$ per head that scales its logits.
#
# $$w_{ts} = \frac{e^{\tau_h s_{ts}}}{e^{\tau_h \nu_t} + \sum_{s'} e^{\tau_h s_{ts'}}},
# \qquad s_{ts} = \frac{q_t \cdot k_s}{\sqrt{H}}, \quad \nu_t = \frac{q_t \cdot n_h}{\sqrt{H}}$$
#
# It keeps the same keys and values in the cache as softmax attention. We train it against
# `mha` on multi-query associative recall (MQAR), decode with the cache, and look at both
# models' attention maps.

# %%
# %matplotlib inline
import dataclasses
import math
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import treescope
from flax import nnx

import attnlab
from attnlab import ModelConfig, runs, viz
from attnlab.contracts.mixer import MixerCall, MixerSettings
from attnlab.data import make_task
from attnlab.nn.mixers.mha import Attention
from attnlab.ops.masks import MASK_VALUE
from attnlab.sweep import grid, markdown_table, plan_sweep, run_sweep

attnlab.compilation_cache()  # programs compiled once are kept on disk for the next run

# %% tags=["parameters"]
# ATTNLAB_NOTEBOOK_TINY=1 (the test suite) trains tiny models for a few steps.
TINY = bool(os.environ.get("ATTNLAB_NOTEBOOK_TINY"))
SEEDS = [0, 1] if TINY else [0, 1, 2]
STEPS = 4 if TINY else 1500

# %% [markdown]
# ## 1. The variant
#
# It subclasses the built-in `Attention` (`mixer="mha"`), which computes q, k and v (with
# RoPE) and keeps keys and values in the cache, and overrides one step: `attend`, which
# receives q `[B, T, N, H]`, the keys and values `[B, S, K, H]` (when decoding: every cache
# slot; the mask says which are written) and the `MixerCall` (its `mask` is one
# `ops.MaskSpec`). `Settings` is the variant's frozen config, validated with errors that
# name the field; parameters are `nnx.Param`s named with their shapes' letters.


# %%
@attnlab.register_mixer("null_key", overwrite=True)  # overwrite: the cell may run again
class NullKeyAttention(Attention):
    """Softmax attention with a learned null key (zero value) and temperature per head."""

    @dataclasses.dataclass(frozen=True)
    class Settings(MixerSettings):
        temperature: float = 1.0  # initial tau of every head

        def validate(self, cfg):
            if not self.temperature > 0:
                self.fail("temperature", "an initial temperature > 0")

    context_parallel = False  # attend below sees the whole sequence

    def __init__(self, cfg, settings, *, rngs):
        super().__init__(cfg, rngs=rngs)
        N, H = cfg.n_heads, cfg.head_dim
        self.log_tau_N = nnx.Param(jnp.full((N,), math.log(settings.temperature), jnp.float32))
        self.null_NH = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (N, H)))

    def attend(self, q_BTNH, k_BSKH, v_BSKH, call: MixerCall):
        if call.bias is not None:
            raise ValueError("null_key: use position='rope' or 'none' (no score bias)")
        G = q_BTNH.shape[2] // k_BSKH.shape[2]  # query heads per key/value head
        k_BSNH, v_BSNH = (jnp.repeat(x, G, axis=2).astype(jnp.float32) for x in (k_BSKH, v_BSKH))
        q_BTNH = q_BTNH.astype(jnp.float32) * self.cfg.attn_scale
        tau_N = jnp.exp(self.log_tau_N[...])
        logits_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH) * tau_N[None, :, None, None]
        null_BNT = jnp.einsum("BTNH,NH->BNT", q_BTNH, self.null_NH[...]) * tau_N[None, :, None]
        logits_BNTS = jnp.where(call.mask.dense(), logits_BNTS, MASK_VALUE)
        both_BNTS = jnp.concatenate([null_BNT[..., None], logits_BNTS], axis=-1)
        weights_BNTS = jax.nn.softmax(both_BNTS, axis=-1)[..., 1:]  # the null's value is 0
        out_BTNH = jnp.einsum("BNTS,BSNH->BTNH", weights_BNTS, v_BSNH).astype(v_BSKH.dtype)
        return out_BTNH, (weights_BNTS if call.return_weights else None)


print(sorted(attnlab.registered_mixers()))

# %% [markdown]
# Checks on random inputs. The null key takes weight from every query. With a zero null key
# and unit temperatures the null logit is 0, so each row is softmax attention's row times
# one factor, $Z / (1 + Z)$: the same layer's q, k and v through `mha` give the shape.

# %%
cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                  max_len=16, position="rope", mixer="null_key")  # fmt: skip
layer = NullKeyAttention(cfg, NullKeyAttention.Settings(), rngs=nnx.Rngs(0))
plain = Attention(cfg, rngs=nnx.Rngs(0))  # the same seed: the same q, k, v, o
x_BTD = jax.random.normal(jax.random.key(1), (2, 6, cfg.d_model))
call = MixerCall(
    positions_BT=jnp.broadcast_to(jnp.arange(6), (2, 6)),
    mask=attnlab.ops.MaskSpec.for_sequence(6, causal=True),
    return_weights=True,
)
_, _, w = layer(x_BTD, call)
assert bool((w.sum(-1) < 1).all()), "the null key takes some weight"
layer.null_NH[...] = jnp.zeros_like(layer.null_NH[...])
layer.log_tau_N[...] = jnp.zeros_like(layer.log_tau_N[...])
_, _, w = layer(x_BTD, call)
_, _, w_plain = plain(x_BTD, call)
np.testing.assert_allclose(w, w_plain * w.sum(-1, keepdims=True), atol=1e-6)
print(f"null-key share of the first query: {1 - float(w[0, 0, 0].sum()):.3f}")
try:
    ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, mixer="null_key",
                mixer_settings={"temperature": -1.0})  # fmt: skip
except attnlab.errors.ConfigError as e:
    print(e)

# %% [markdown]
# `treescope` shows what the class declares: the module with its parameters (the
# projections of softmax attention plus `log_tau_N` and `null_NH`, each named by its
# shape's letters), and the cache of a model built with it, which keeps the same `keys` and
# `values` as `mha`, `[L, B, K, S, H]`.

# %%
treescope.display(NullKeyAttention(cfg, NullKeyAttention.Settings(), rngs=nnx.Rngs(0)))
treescope.display(attnlab.init_cache(cfg, batch_size=2, max_len=cfg.max_len))

# %% [markdown]
# ## 2. Trained against softmax attention on MQAR
#
# `experiments/attention_zoo.py` holds the MQAR setup (pairs of keys and values, then every
# key asked again; the loss counts the recalled values alone). The comparison is an ordinary
# sweep over `model.mixer` and seeds; seeds of one variant share one program.

# %%
ROOT = next(
    p for p in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents) if (p / "experiments").is_dir()
)
spec = str(ROOT / "experiments" / "attention_zoo.py") + (":tiny" if TINY else "")
overrides = [
    f"--config.train.steps={STEPS}",
    f"--config.train.log_every_steps={2 if TINY else 100}",
    f"--config.eval.every_steps={STEPS if TINY else 500}",
    f"--config.checkpoint.every_steps={STEPS}",
]
VARIANTS = ["mha", "null_key"]
plan = plan_sweep(spec, overrides, grid({"model.mixer": VARIANTS, "train.seed": SEEDS}))
root = pathlib.Path(tempfile.mkdtemp(prefix="attnlab_null_key_"))
results = run_sweep(plan, root)

# %%
print(markdown_table(results))
for row in results["trials"]:
    assert row["status"] == "finished" and row["steps"] == STEPS, row
    assert math.isfinite(row["final_eval_loss"]), row
accuracy = {v: [] for v in VARIANTS}
for row in results["trials"]:
    accuracy[row["overrides"]["model.mixer"]].append(row["final_eval_accuracy"])
for v, xs in accuracy.items():
    print(f"{v:9s} MQAR accuracy {np.mean(xs):.3f} ± {np.std(xs, ddof=1):.3f} over {len(xs)} seeds")

# %% [markdown]
# ## 3. Decoding with the cache
#
# Each trained run loads back with `runs.load_run` (the variant is registered in this
# kernel). Generation through the KV cache must write the same tokens as generation that
# recomputes the whole prefix at every step.

# %%
trials = {
    t.overrides["model.mixer"]: root / t.name for t in plan.trials if t.overrides["train.seed"] == 0
}
loaded = {v: runs.load_run(trials[v]) for v in VARIANTS}
task = make_task(loaded["mha"].config.data)
batch = task.eval_batches(batch_size=2, num_batches=1)[0]
answer_at = int(np.flatnonzero(batch["loss_mask"][0])[0])  # the first query's key
prompts = [batch["inputs"][0, : answer_at + 1].tolist(), batch["inputs"][1, :answer_at].tolist()]
for v, run in loaded.items():
    cached = attnlab.generate(run.model, prompts, 4, eos_id=None)
    again = attnlab.generate(run.model, prompts, 4, eos_id=None, recompute=True)
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(again.tokens))
    print(f"{v:9s} cache == recompute; row 0 continues with {np.asarray(cached.tokens)[0][-4:]}")

# %% [markdown]
# ## 4. Attention maps
#
# One MQAR row through both trained models, the last layer's weights per head. The null-key
# model's rows need not sum to one: what is missing went to the null key.

# %%
ids_1T = jnp.asarray(batch["inputs"][:1])
labels = task.decode(batch["inputs"][0]).replace("<bos>", "B").replace("<sep>", ".").split()
figures = {}
for v, run in loaded.items():
    out = run.model(ids_1T, return_weights=True)
    weights_NTS = np.asarray(out.weights[-1]["self"][0])
    assert weights_NTS.shape[1:] == (ids_1T.shape[1], ids_1T.shape[1])
    total_T = weights_NTS.sum(-1)
    if v == "mha":
        np.testing.assert_allclose(total_T, 1.0, atol=1e-5)
    else:
        assert (total_T <= 1 + 1e-5).all()
        print(f"weight on the null key per head: {np.round(1 - total_T.mean(-1), 3)}")
    figures[v] = viz.plot_attention(
        weights_NTS, labels if len(labels) == ids_1T.shape[1] else None, title=v
    )
figures["mha"]

# %%
figures["null_key"]
