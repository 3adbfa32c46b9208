"""What a student keeps of its teacher: loss, passkey retrieval, decode speed, cache bytes.

- ``eval_loss``: mean next-token cross-entropy (nats) over fixed validation windows.
- ``passkey``: a number of ``digits`` digits written early in a window of validation text
  (``key = 12345`` on a line of its own), the text continuing, then ``key = `` again at
  the end: the share of the digits the model predicts greedily, teacher-forced (a copy
  over the window, which a sliding window shorter than the distance cannot do alone).
- ``harness``: the RULER-style tasks as lm-eval tasks (``attnlab.evaluation.ruler_harness``),
  written at the run's window length in the run's tokenizer and scored by the harness
  (greedy generation through the cache, recall of the references).
- ``decode_profile``: per context length ``L`` (1k, 8k, 32k tokens), the cache bytes
  ``attnlab.kv_cache_bytes`` counts for one row (float32) and the seconds of one decode
  step with a cache holding ``L - 1`` tokens (the median of a few, after a warm-up). The
  model is rebuilt with ``max_len = L`` (RoPE has no table, so its parameters are the
  same); the cache's contents do not change the time, so they are left at zeros.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from attnlab.kv_cache import init_cache, kv_cache_bytes

LENGTHS = (1024, 8192, 32768)


def eval_loss(model, batches) -> float:
    """Mean cross-entropy per token over ``batches`` (``stages.eval_batches``)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def one(params, batch):
        logits = nnx.merge(graphdef, params)(batch["inputs"]).logits.astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(ce * batch["loss_mask"]), jnp.sum(batch["loss_mask"])

    s = n = 0.0
    for b in batches:
        a, c = one(params, b)
        s, n = s + float(a), n + float(c)
    return s / max(n, 1.0)


def passkey_rows(encode, val_ids, *, seq_len: int, rows: int = 32, digits: int = 5, seed=0):
    """``(ids_RT, answer_positions_RD)``: windows of ``seq_len`` tokens of validation text
    with ``key = NNNNN`` near the start and ``key = `` + the digits at the end."""
    rng = np.random.default_rng(seed)
    out, where = [], []
    for _ in range(rows):
        key = "".join(str(d) for d in rng.integers(0, 10, digits))
        head = np.asarray(encode(f"\nkey = {key}\n"))
        tail = np.asarray(encode(f"\nkey = {key}"))
        fill = seq_len - len(head) - len(tail)
        start = int(rng.integers(0, len(val_ids) - fill))
        ids = np.concatenate([head, val_ids[start : start + fill], tail])
        out.append(ids)
        where.append(np.arange(seq_len - digits, seq_len))
    return np.stack(out).astype(np.int32), np.stack(where)


def passkey(model, ids_RT, where_RD) -> float:
    """The share of passkey digits predicted (argmax, teacher-forced)."""
    logits = jax.jit(lambda m, x: m(x).logits)(model, jnp.asarray(ids_RT[:, :-1]))
    pred = np.asarray(jnp.argmax(logits, -1))
    rows = np.arange(len(ids_RT))[:, None]
    return float(np.mean(pred[rows, where_RD - 1] == ids_RT[rows, where_RD]))


def decode_profile(model, lengths=LENGTHS, repeats: int = 5) -> dict:
    """``{L: {"cache_bytes", "step_seconds"}}`` for one row (module docstring)."""
    from attnlab.decode import Decoder

    out = {}
    params = nnx.state(model)
    for L in lengths:
        cfg = model.cfg.replace(max_len=max(L, model.cfg.max_len))
        long = nnx.merge(nnx.graphdef(_abstract(cfg)), params)
        decoder, p = Decoder.for_model(long)
        cache = init_cache(cfg, 1, L, jnp.float32, on_overflow="flag")  # generate's step
        cache = cache.replace(lengths=jnp.full((1,), L - 1, jnp.int32))
        step = jax.jit(decoder.decode_step_fn)
        tok = jnp.ones((1,), jnp.int32)
        jax.block_until_ready(step(p, cache, tok))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(step(p, cache, tok))
            times.append(time.perf_counter() - t)
        out[int(L)] = {
            "cache_bytes": int(kv_cache_bytes(cfg, 1, L, "float32")),
            "step_seconds": float(np.median(times)),
        }
    return out


def _abstract(cfg):
    from attnlab.nn.models import build_model

    return nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))


def harness(model, tokenizer, tasks: str, length: int, folder, *, examples: int, seed: int):
    """``{task: recall}`` of the harness on the RULER-style ``tasks`` at ``length`` tokens
    (task folder written to ``folder``); a task that does not fit the length is left out."""
    from attnlab.evaluation import ruler_harness
    from attnlab.evaluation.backends import for_model
    from attnlab.evaluation.harness import run_harness

    decode = lambda ids: tokenizer.decode(np.asarray(ids, np.int64))
    backend = for_model("attnlab:transfer", model, encode=tokenizer.encode, decode=decode)
    names = ruler_harness.write_tasks(folder, tasks, [length], backend.encode, decode,
                                      examples=examples, seed=seed)  # fmt: skip
    if not names:
        return {}
    res = run_harness(backend, names, include_path=folder, bootstrap_iters=0)["results"]
    return {name: float(res[name]["recall,none"]) for name in names}
