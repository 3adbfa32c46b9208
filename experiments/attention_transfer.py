"""Attention transfer (LoLCATs, Zhang et al. 2024): a trained Transformer's attention layers
turned into another mixer by distillation and LoRA, then measured against the teacher.

The teacher is a Hugging Face folder or an attnlab run (``--config.transfer.teacher``);
the plan puts ``transfer.mixer`` (``lolcats`` by default: softmax over a window of 32 plus
linear attention with learned feature maps) in the layers ``transfer.layers`` selects
(every layer unless told), or follows ``transfer.plan`` (one name per layer, ``keep`` for
softmax attention; a mixer from ``--import my_variant.py`` too). Stage 1 trains only the
new mixers' parameters to match each layer's attention output (MSE, lr 1e-2); stage 2
trains LoRA adapters (rank 8, alpha 16 on q, k, v, o) with next-token loss; the swap
baseline trains adapters and the new mixers together for the same tokens without stage 1.
``attnlab.transfer.pipeline`` says what lands in the work directory (``results.json``)::

    attnlab train --config experiments/char_lm.py --workdir runs/char_lm
    attnlab export-hf --workdir runs/char_lm --out runs/char_lm_hf
    cp runs/char_lm/tokenizer.json runs/char_lm_hf/
    python experiments/attention_transfer.py --workdir runs/at \\
        --config.transfer.teacher=runs/char_lm_hf
    python experiments/attention_transfer.py --ablation runs/at_ablation \\
        --teacher runs/char_lm_hf --seeds 0,1,2          # the LoLCATs ablation and hybrids
    python experiments/attention_transfer.py --report runs/at_ablation   # table + figures

``:tiny`` is the CPU twin (a few steps at a tiny length).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from ml_collections import ConfigDict

from attnlab.experiment import base_config
from attnlab.experiment.schema import layer_selection

VARIANTS = ("tiny",)


def get_config(variant=None):
    c = base_config()
    c.name = "attention_transfer"
    # The teacher decides the student's model; this group is char_lm's (the teacher of the
    # measurements), what the commands that read any experiment (train a step, lower) see.
    c.model.update(arch="decoder", vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                   max_len=128, position="rope", norm="rmsnorm", ffn="swiglu", d_ff=384,
                   norm_bias=False)  # fmt: skip
    c.data.update(kind="text", path="", tokenizer="char", seq_len=128, max_chars=2_000_000)
    c.train.update(steps=600, batch_size=16)
    c.train.update(seed=0)
    c.transfer = ConfigDict(
        dict(
            teacher="",  # a Hugging Face folder or an attnlab run's work directory
            teacher_step=-1,  # a run's checkpoint (-1: its newest)
            plan=(),  # one name per layer ("keep": softmax attention); () : mixer in layers
            mixer="lolcats",
            mixer_settings=ConfigDict(dict(window=32, feature_dim=0, factor_init=0.0)),
            layers=layer_selection(),  # none given: every layer
            init="matching",  # fresh | matching | attention
            stage1_steps=100,
            stage1_lr=1e-2,
            stage2_steps=200,
            stage2_lr=3e-3,
            warmup=10,
            batch_size=16,
            seq_len=128,
            swap_baseline=True,
            swap_trains="lora",  # "lora": the recipe less stage 1; "lora+mixer": + new mixers
            swap_settings='{"window": 0}',  # LoLCATs' "swap & finetune": no window, no stage 1
            eval_batches=8,
            passkey_rows=64,
            harness_tasks="passkey,niah_single",  # RULER-style lm-eval tasks at seq_len
            harness_examples=16,
            decode_lengths=(1024, 8192, 32768),
            log_every=10,
            checkpoint_every=50,
        )
    )
    c.lora = ConfigDict(dict(rank=8, alpha=16.0, targets=("q", "k", "v", "o"), dropout=0.0))
    c.distill = ConfigDict(
        dict(ce=1.0, kl=0.0, hidden=0.0, attention_mse=0.0, temperature=1.0, layers=())
    )
    if variant == "tiny":
        c.model.update(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=32)
        c.data.update(seq_len=32, max_chars=50_000)
        c.train.update(steps=3, batch_size=4)
        c.transfer.update(
            stage1_steps=3,
            stage2_steps=3,
            batch_size=4,
            seq_len=32,
            eval_batches=1,
            passkey_rows=4,
            harness_tasks="",  # no task fits 32 tokens (tests/test_attention_transfer.py)
            decode_lengths=(64,),
            log_every=1,
            checkpoint_every=2,
        )
    return c


# The ablation: rows of (name, overrides); the swap baseline comes with the linear run.
def ablation_rows(n_layers: int):
    linear = {"transfer.mixer_settings.window": 0}
    quarter = tuple("keep" if i % 4 == 0 else "lolcats" for i in range(n_layers))
    half = tuple("keep" if i % 2 == 0 else "lolcats" for i in range(n_layers))
    return {
        "linear": {**linear, "transfer.swap_baseline": True},
        "window": {"transfer.swap_settings": "{}"},  # the default; its swap arm keeps the window
        "hybrid_quarter": {**linear, "transfer.plan": quarter, "transfer.swap_baseline": False},
        "hybrid_half": {**linear, "transfer.plan": half, "transfer.swap_baseline": False},
    }


def _set(cfg, dotted: str, value):
    *groups, leaf = dotted.split(".")
    node = cfg
    for g in groups:
        node = node[g]
    with node.unlocked() if hasattr(node, "unlocked") else _null():
        node[leaf] = value


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None):
    from attnlab import experiment
    from attnlab.transfer import pipeline

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", help="run the pipeline in this directory")
    p.add_argument("--variant", default=None, choices=VARIANTS)
    p.add_argument("--import", dest="imports", action="append", default=[])
    p.add_argument("--ablation", help="run the ablation rows x seeds in this directory")
    p.add_argument("--teacher", help="the ablation's teacher")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rows", default="", help="a comma list of ablation rows (default: all)")
    p.add_argument("--report", help="write the ablation's table and figures")
    args, overrides = p.parse_known_args(argv)
    spec = __file__ + (f":{args.variant}" if args.variant else "")
    if args.report:
        from attnlab.transfer.report import report

        print(report(pathlib.Path(args.report)))
        return
    if args.ablation:
        base = experiment.load_config(spec, overrides, args.imports)
        from attnlab.transfer.plan import teacher_config

        _set(base, "transfer.teacher", args.teacher)
        n = teacher_config(base.transfer)[0].n_layers
        rows = ablation_rows(n)
        chosen = args.rows.split(",") if args.rows else list(rows)
        for seed in (int(s) for s in args.seeds.split(",")):
            for name in chosen:
                cfg = experiment.load_config(spec, overrides, args.imports)
                _set(cfg, "transfer.teacher", args.teacher)
                _set(cfg, "train.seed", seed)
                for k, v in rows[name].items():
                    _set(cfg, k, v)
                where = pathlib.Path(args.ablation) / f"{name}_seed{seed}"
                print(f"== {where}", flush=True)
                pipeline.run(cfg, where)
        return
    if not args.workdir:
        p.error("give --workdir (or --ablation / --report)")
    cfg = experiment.load_config(spec, overrides, args.imports)
    res = pipeline.run(cfg, args.workdir)
    keys = ("teacher_eval_loss", "student_eval_loss", "swap_only_eval_loss", "trainable_fraction")
    print(json.dumps({k: res.get(k) for k in keys}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
