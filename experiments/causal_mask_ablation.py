"""The causal-mask ablation: one decoder trained with and without its causal mask.

Without the mask each position can read the token it must predict, so the training loss
falls far lower, yet the model is useless for generation, which cannot see the future (its
samples come from ``attnlab.generate``, which recomputes the full forward pass for a
non-causal model: the cached decoder is exact only for causal models).
Run it as a sweep over ``model.causal`` to get both curves and both samples side by side::

    attnlab sweep --config experiments/causal_mask_ablation.py --workdir runs/ablation
"""

from attnlab.experiment import base_config
from attnlab.experiment.harness import tiny_twin
from attnlab.experiment.presets import EMBEDDED_CHARS
from attnlab.sweep import grid


def get_config(variant=None):
    c = base_config()
    c.name = "causal_mask_ablation"
    # With RoPE the unmasked arm finds the copy shortcut within ~150 steps; with learned
    # positions it takes ~400, so the contrast would sit at the end of the budget.
    c.model.update(arch="decoder", vocab_size=256, d_model=96, n_layers=3, n_heads=4, max_len=64,
                   position="rope", norm="layernorm", ffn="gelu", causal=True)  # fmt: skip
    c.data.update(EMBEDDED_CHARS, seq_len=64, max_chars=1_000_000)
    c.optim.update(learning_rate=2e-3, warmup_steps=30)
    c.train.update(steps=400, batch_size=16, log_every_steps=20)
    c.eval.update(
        every_steps=100, batches=4, batch_size=16, sample_tokens=120, sample_prompt="def "
    )
    c.checkpoint.update(every_steps=200)
    if variant == "tiny":
        tiny_twin(c, max_len=16, seq_len=16, max_chars=20_000, sample_tokens=8)
    return c


def sweep(variant=None):
    """Both arms of the ablation (two shapes of program: they train one after the other)."""
    return grid({"model.causal": [True, False]})
