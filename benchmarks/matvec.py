"""How fast this machine's matrix products stream weights at decoding's shapes.

A chain of GPT-2 small's feed-forward shapes (``--layers`` pairs of ``[768, 3072]`` and
``[3072, 768]`` weights, a tanh between them, then the tied head ``[50257, 768]``: 607 MB
in float32 for 24 pairs, more than the CPU's caches) run as one jitted program on ``B``
rows, so every weight comes from memory once per call, as in a decoding step. Each row of
the JSON is one way of computing it, in GB/s of weights read (best of ``--repeats``) and
as a fraction of the machine's read rate (``benchmarks/machine.py``, measured in the same
run):

* ``[in, out]``: ``x @ W``, the layout the model's weights have;
* ``[out, in]``: the same weights stored transposed, ``einsum("bi,oi->bo")``;
* ``eigen``: ``[in, out]`` with XLA:CPU's YNNPACK dots turned off (a child process with
  ``--xla_cpu_experimental_ynn_fusion_type=``);
* ``numpy`` and ``torch`` (where installed): the same chain eagerly, one product a call;
* ``gpt2 dots``: GPT-2 small's own dots and nothing else: 12 layers of q, k, v and o
  (``[768, 768]`` each), ``[768, 3072]`` and ``[3072, 768]``, then the head (498 MB), in
  ``[in, out]``; its ``of_read`` is what a decoding step's dots can reach, before attention,
  norms and sampling; ``gpt2 dots [out, in]`` the same with every layer weight stored
  transposed (the head is ``[out, in]`` in both, as a tied embedding is).

    python benchmarks/matvec.py [--batches 1,8] [--layers 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import machine  # benchmarks/machine.py: the read rate, the timer
import numpy as np

D, F, V = 768, 3072, 50257


def weights(layers: int, out_in: bool = False):
    rng = np.random.default_rng(0)
    up = [rng.standard_normal((D, F), dtype=np.float32) * 0.02 for _ in range(layers)]
    down = [rng.standard_normal((F, D), dtype=np.float32) * 0.02 for _ in range(layers)]
    if out_in:
        up, down = [w.T.copy() for w in up], [w.T.copy() for w in down]
    head = rng.standard_normal((V, D), dtype=np.float32) * 0.02
    return up, down, head


def nbytes(layers: int) -> int:
    return 4 * (2 * layers * D * F + V * D)


def jax_seconds(batch: int, layers: int, out_in: bool, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    mm = (lambda x, w: jnp.einsum("bi,oi->bo", x, w)) if out_in else (lambda x, w: x @ w)
    up, down, head = (jax.device_put(w) for w in weights(layers, out_in))

    @jax.jit
    def chain(x, up, down, head):
        for a, b in zip(up, down, strict=True):
            x = x + mm(jnp.tanh(mm(x, a)), b)
        return x @ head.T

    x = jnp.ones((batch, D), jnp.float32)
    return machine.best_seconds(lambda: jax.block_until_ready(chain(x, up, down, head)), repeats)


def gpt2_dots(batch: int, repeats: int, out_in: bool = False) -> tuple[float, int]:
    """Seconds and bytes of GPT-2 small's dots alone (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)

    def w(rows, cols):
        a = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        return jax.device_put(a.T.copy() if out_in and rows * cols != V * D else a)

    mm = (lambda x, a: jnp.einsum("bi,oi->bo", x, a)) if out_in else (lambda x, a: x @ a)
    layers = [dict(q=w(D, D), k=w(D, D), v=w(D, D), o=w(D, D), up=w(D, F), down=w(F, D))
              for _ in range(12)]  # fmt: skip
    head = w(V, D)

    @jax.jit
    def step(x, layers, head):
        for p in layers:
            x = x + mm(jnp.tanh(mm(x, p["q"]) + mm(x, p["k"]) * mm(x, p["v"])), p["o"])
            x = x + mm(jnp.tanh(mm(x, p["up"])), p["down"])
        return x @ head.T

    x = jnp.ones((batch, D), jnp.float32)
    size = sum(a.nbytes for p in layers for a in p.values()) + head.nbytes
    return machine.best_seconds(lambda: jax.block_until_ready(step(x, layers, head)), repeats), size


def eager_seconds(lib: str, batch: int, layers: int, repeats: int) -> float | None:
    up, down, head = weights(layers)
    if lib == "torch":
        try:
            import torch
        except ImportError:
            return None
        up, down = [torch.from_numpy(w) for w in up], [torch.from_numpy(w) for w in down]
        head, tanh = torch.from_numpy(head), torch.tanh
        x0 = torch.ones((batch, D))
    else:
        tanh, x0 = np.tanh, np.ones((batch, D), np.float32)

    def chain():
        x = x0
        for a, b in zip(up, down, strict=True):
            x = x + tanh(x @ a) @ b
        return x @ head.T

    if lib == "torch":
        with torch.no_grad():
            return machine.best_seconds(chain, repeats)
    return machine.best_seconds(chain, repeats)


def child(args, flags: str) -> float:
    """Seconds of the ``[in, out]`` chain in a fresh process with ``XLA_FLAGS=flags``."""
    env = dict(os.environ, XLA_FLAGS=flags)
    cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=ints, default=[1, 8])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # one figure per batch, for the parent
        print(json.dumps({B: jax_seconds(B, args.layers, False, args.repeats)
                          for B in args.batches}))  # fmt: skip
        return
    load = [round(x, 2) for x in os.getloadavg()]
    limits = machine.limits()
    read = max(limits["read_gbps"].values())
    eigen = child(args, "--xla_cpu_experimental_ynn_fusion_type=")
    rows = []
    for B in args.batches:
        ways = {
            "[in, out]": jax_seconds(B, args.layers, False, args.repeats),
            "[out, in]": jax_seconds(B, args.layers, True, args.repeats),
            "eigen": eigen[str(B)],
            "numpy": eager_seconds("numpy", B, args.layers, args.repeats),
            "torch": eager_seconds("torch", B, args.layers, args.repeats),
        }
        ways["gpt2 dots"], gpt2_bytes = gpt2_dots(B, args.repeats)
        ways["gpt2 dots [out, in]"], _ = gpt2_dots(B, args.repeats, out_in=True)
        for way, seconds in ways.items():
            if seconds is None:
                continue
            size = gpt2_bytes if way.startswith("gpt2") else nbytes(args.layers)
            gbps = size / seconds / 1e9
            flops = 2 * B * size / 4 / seconds
            row = dict(batch=B, way=way, ms=round(1e3 * seconds, 2), gbps=round(gbps, 1))
            rows.append(row | dict(gflops=round(flops / 1e9, 1), of_read=round(gbps / read, 3)))
            print(json.dumps(rows[-1]), flush=True)
    out = dict(benchmark="matvec", machine=machine.describe() | dict(load_average=load),
               limits=limits, settings=vars(args) | dict(megabytes=nbytes(args.layers) / 1e6),
               rows=rows)  # fmt: skip
    machine.emit(out, args.out)


if __name__ == "__main__":
    main()
