"""Position encodings compared on associative recall (the ``induction`` task), decoder-only.

Each sequence lists key/value pairs, then one of the keys; the model must answer with the
value paired with it, which needs attention to find the earlier key (content) and read the
token after it (position). ``sweep()`` trains learned, sinusoidal, RoPE and ALiBi positions
with three seeds each: the positions change the program, the seeds do not, so
``attnlab sweep`` runs four vmapped groups of three::

    attnlab sweep --config experiments/attention_variants.py --workdir runs/positions
"""

from attnlab.experiment import base_config
from attnlab.experiment.harness import tiny_twin
from attnlab.sweep import grid


def get_config(variant=None):
    c = base_config()
    c.name = "attention_variants"
    c.model.update(arch="decoder", vocab_size=12, d_model=64, n_layers=2, n_heads=4, max_len=24,
                   position="learned", norm="layernorm", ffn="gelu", d_ff=128)  # fmt: skip
    c.data.update(kind="induction", seq_len=24, num_symbols=8, min_len=2, max_len=6)
    c.optim.update(learning_rate=3e-3, warmup_steps=50, weight_decay=0.01)
    c.train.update(steps=1200, batch_size=32, log_every_steps=100)
    c.eval.update(every_steps=400, batches=4, batch_size=64, sample_tokens=0)
    c.checkpoint.update(every_steps=600, max_to_keep=1)
    if variant == "tiny":
        tiny_twin(c, d_model=16, d_ff=32, max_len=16, seq_len=16)
        c.data.max_len = 4
    return c


def sweep(variant=None):
    """Four position encodings x three seeds."""
    return grid(
        {"model.position": ["learned", "sinusoidal", "rope", "alibi"], "train.seed": [0, 1, 2]}
    )
