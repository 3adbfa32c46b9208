"""The PyTorch baselines the attnlab figures are compared with, measured in this process.

Prints JSON: the machine, then

* ``train``: tokens/s of a GPT-2-style decoder's training step (learned positions,
  LayerNorm without bias, exact GELU, a 4x MLP, tied embeddings, AdamW, gradient clipping:
  the block of the widely used nanoGPT baseline, written here in plain PyTorch, eager) at
  the shapes of ``benchmarks/train_throughput.py``;
* ``decode``: tokens/s of ``transformers``' greedy ``generate`` (KV cache) for a randomly
  initialised GPT-2 small in float32, at the batch sizes of ``benchmarks/decode.py``
  (prompt 16 tokens, 64 new ones).

Run it next to the attnlab benchmarks on the same idle machine, one after the other;
ratios are only meaningful between figures taken that way.

    python benchmarks/torch_reference.py [--shapes small,medium] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
from torch import nn
from torch.nn import functional as F

SHAPES = {  # as in benchmarks/train_throughput.py
    "small": dict(n_layers=4, n_heads=4, d_model=128, seq_len=64, batch=12),
    "medium": dict(n_layers=6, n_heads=6, d_model=384, seq_len=256, batch=64),
}


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, bias=False)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        shape = (B, T, self.heads, D // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq_len):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, std=0.02) if p.dim() > 1 else None

    def forward(self, ids, targets):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tokens.weight.T
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def train_throughput(s, steps, vocab=65, device="cpu", compiled=False):
    """Tokens/s of the training step at shape ``s``; on ``device="cuda"`` in bfloat16
    autocast, and ``compiled`` with ``torch.compile`` (nanoGPT's GPU setting)."""
    torch.manual_seed(0)
    model = GPT(vocab, s["d_model"], s["n_layers"], s["n_heads"], s["seq_len"]).to(device)
    opt = torch.optim.AdamW(  # fused on a GPU, as nanoGPT's configure_optimizers does
        model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=device == "cuda"
    )
    ids = torch.randint(0, vocab, (s["batch"], s["seq_len"]), device=device)
    targets = torch.randint(0, vocab, (s["batch"], s["seq_len"]), device=device)
    forward = torch.compile(model) if compiled else model
    autocast = torch.autocast(device, torch.bfloat16, enabled=device == "cuda")

    def step():
        with autocast:
            loss = forward(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    return dict(shape=s, device=device, compiled=compiled,
                tokens_per_sec=round(s["batch"] * s["seq_len"] / dt, 1),
                step_ms=round(dt * 1e3, 2))  # fmt: skip


def decode_throughput(
    batch, new_tokens=64, prompt_len=16, repeats=3, device="cpu", dtype="float32"
):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    model = model.to(device=device, dtype=getattr(torch, dtype))  # weights and cache
    ids = torch.randint(1, 50257, (batch, prompt_len), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              use_cache=True, pad_token_id=0, attention_mask=torch.ones_like(ids))  # fmt: skip
    best = math.inf
    with torch.inference_mode():
        model.generate(ids, **kw)
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            sync()
            best = min(best, time.perf_counter() - t0)
    tokens_per_s = round(batch * new_tokens / best, 1)
    return dict(
        batch=batch, new_tokens=new_tokens, prompt_len=prompt_len, tokens_per_s=tokens_per_s,
        seconds=round(best, 3), device=device, dtype=dtype,
    )  # fmt: skip


def main():
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="small,medium")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batches", type=ints, default=[1, 8])
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    args = p.parse_args()
    out = dict(
        benchmark="torch_reference",
        machine=dict(
            platform=platform.platform(),
            cpus=os.cpu_count(),
            load_average=list(os.getloadavg()),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
        ),  # fmt: skip
        train=[],
        decode=[],
    )
    if not args.skip_train:
        for name in args.shapes.split(","):
            out["train"].append(dict(name=name, **train_throughput(SHAPES[name], args.steps)))
            print(json.dumps(out["train"][-1]), flush=True)
    if not args.skip_decode:
        for batch in args.batches:
            out["decode"].append(decode_throughput(batch))
            print(json.dumps(out["decode"][-1]), flush=True)
    out["machine"]["load_average_end"] = list(os.getloadavg())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
