"""The train-step cost of each built-in step metric and of multi-token prediction, against the
plain step, at the 6 x 384 shape (6 layers, 6 heads, d_model 384, SwiGLU 1536, RoPE,
RMSNorm, a 256-symbol vocabulary).

Variants: ``plain`` (no metric), each built-in metric of ``attnlab.metrics`` alone
(``--config.train.metrics=(name,)``), ``all`` of them together, and ``mtp1``/``mtp2``
(``model.mtp_depth`` 1 and 2, the MTP loss joining the objective). Each variant is a
``Trainer`` step (forward, backward, AdamW update, the metrics' accumulation); all are
compiled first, then timed in ``--repeats`` rounds that step every variant once in turn,
and each keeps its best step, so a change in a shared machine's load reaches all alike.

Prints one JSON object: the config, the machine, per variant ms per step, the ratio to
``plain`` and the compile seconds; ``--out FILE`` writes it too.

``--speculative STEPS`` also trains ``char_lm`` (4 x 128) with ``model.mtp_depth=2`` for
STEPS steps and decodes 4 prompts of its validation text with
``attnlab.speculative_generate`` at depth 1 and 2: the tokens each verification pass added,
whether the tokens equal greedy ``generate``'s, and the wall time of both.

    python benchmarks/step_metrics.py [--batch 16] [--seq 256] [--repeats 3] [--quick]
                                      [--variants plain,attn_entropy,mtp1] [--speculative 300]
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import machine  # benchmarks/machine.py: the machine, measured in this run
import numpy as np

from attnlab import experiment
from attnlab.metrics import LOSS_METRICS, registered_metrics
from attnlab.train import Trainer

REPO = pathlib.Path(__file__).resolve().parents[1]
SHAPE = dict(n_layers=6, n_heads=6, d_model=384, d_ff=1536, vocab_size=256)


def observed_metrics() -> list[str]:
    """The built-in metrics a config may select (those a model implies are left out)."""
    return [n for n in registered_metrics() if n not in LOSS_METRICS and n != "moe_router"]


def config(variant: str, batch: int, seq: int):
    cfg = experiment.load_config(f"{REPO / 'experiments' / 'char_lm.py'}")
    cfg.model.update(SHAPE | dict(max_len=seq + 8, ffn="swiglu"))
    cfg.data.seq_len = seq
    cfg.train.batch_size = batch
    if variant == "all":
        cfg.train.metrics = tuple(observed_metrics())
    elif variant.startswith("mtp"):
        cfg.model.mtp_depth = int(variant[3:])
    elif variant != "plain":
        cfg.train.metrics = (variant,)
    return cfg


class Variant:
    """One variant's trainer, state and batch, compiled on creation."""

    def __init__(self, variant: str, batch: int, seq: int):
        self.trainer = Trainer(config(variant, batch, seq), kind="lm")
        rng = np.random.default_rng(0)
        V = SHAPE["vocab_size"]
        self.data = {
            "inputs": rng.integers(0, V, (batch, seq), dtype=np.int32),
            "targets": rng.integers(0, V, (batch, seq), dtype=np.int32),
            "loss_mask": np.ones((batch, seq), np.float32),
        }
        self.state = self.trainer.init_state()
        start = time.perf_counter()
        self.step()  # compiles
        self.compile_s = time.perf_counter() - start

    def step(self):
        self.state, out = self.trainer.train_step(self.state, self.data)
        jax.block_until_ready(out["loss"])

    def seconds(self) -> float:
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start


def measure(variants, batch: int, seq: int, repeats: int) -> dict:
    """Best ms per step of each variant over ``repeats`` rounds, the variants interleaved in
    each round, so a change in the machine's load reaches them all alike."""
    built = {v: Variant(v, batch, seq) for v in variants}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for v, b in built.items():
            best[v] = min(best[v], b.seconds())
    return {
        v: dict(ms_per_step=best[v] * 1e3, compile_s=round(built[v].compile_s, 2)) for v in variants
    }


def speculative(steps: int, new_tokens: int = 96) -> dict:
    """Tokens per verification pass of a char model trained with two MTP modules."""
    import tempfile

    from attnlab import generate, speculative_generate
    from attnlab.runs import load_run, train

    cfg = experiment.load_config(f"{REPO / 'experiments' / 'char_lm.py'}")
    cfg.model.mtp_depth = 2
    cfg.train.update(steps=steps, log_every_steps=steps)
    cfg.eval.update(every_steps=steps, sample_tokens=0)
    cfg.checkpoint.update(every_steps=steps)
    cfg.track.update(tensorboard=False)
    with tempfile.TemporaryDirectory() as tmp:
        record = train(cfg, pathlib.Path(tmp) / "run", progress=False)
        run = load_run(pathlib.Path(tmp) / "run")
    val = np.asarray(run.task.val_ids)
    prompts = np.stack([val[i * 997 : i * 997 + 16] for i in range(4)]).astype(np.int32)
    greedy = lambda: np.asarray(generate(run.model, prompts, new_tokens, temperature=0.0).tokens)
    want = greedy()
    out = {"train_steps": steps, "train_loss": record.get("train_loss"),
           "mtp_losses": [record.get(f"mtp_loss_{k}") for k in (1, 2)],
           "greedy_ms": machine.best_seconds(greedy, 1) * 1e3}  # fmt: skip
    for depth in (1, 2):
        r = speculative_generate(run.model, prompts, new_tokens, depth=depth)
        call = lambda d=depth: speculative_generate(run.model, prompts, new_tokens, depth=d)
        out[f"depth{depth}"] = dict(
            tokens_per_step=round(r.tokens_per_step, 3),
            equals_greedy=bool((r.tokens == want).all()),
            ms=machine.best_seconds(call, 1) * 1e3,
        )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="", help="comma-separated; default: every variant")
    p.add_argument("--quick", action="store_true", help="batch 2, context 64, 1 repeat")
    p.add_argument("--speculative", type=int, default=0, help="train steps (0: skip)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.seq, a.repeats = 2, 64, 1
    variants = ["plain", *observed_metrics(), "all", "mtp1", "mtp2"]
    if a.variants:
        variants = [v.strip() for v in a.variants.split(",") if v.strip()]
        if "plain" not in variants:
            variants.insert(0, "plain")
    about = machine.describe()
    results = measure(variants, a.batch, a.seq, a.repeats)
    plain = results["plain"]["ms_per_step"]
    for r in results.values():
        r["vs_plain"] = round(r["ms_per_step"] / plain, 3)
        r["ms_per_step"] = round(r["ms_per_step"], 2)
    out = dict(
        benchmark="step_metrics",
        config=dict(SHAPE, batch=a.batch, seq_len=a.seq, repeats=a.repeats, optimizer="adamw"),
        machine=about,
        results=results,
    )
    if a.speculative:
        out["speculative"] = speculative(a.speculative)
    machine.print_json(out, a.out, indent=2)


if __name__ == "__main__":
    main()
