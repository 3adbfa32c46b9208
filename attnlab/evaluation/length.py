"""Loss by evaluation length: how a model behaves beyond the length it trained at.

``evaluate_lengths(scorable, lengths, modes)`` scores windows of ``L`` tokens of held-out
text at each length ``L``:

``chunks``
    consecutive non-overlapping windows of ``L`` tokens; every token is scored, so a token's
    context is anything from 0 to ``L - 1`` tokens (ALiBi's "non-overlapping" evaluation).
``sliding``
    windows of ``L`` tokens every ``stride`` tokens (default ``L // 4``); only each window's
    last ``stride`` tokens are scored, so every scored token sees at least ``L - stride``
    tokens behind it (ALiBi's sliding window, whose stride is 1, at a quarter of the cost).

Each window runs through the KV cache in prefill chunks of at most ``chunk`` tokens (the
largest divisor of ``L`` that fits): the scores are ``[B, N, C, S]`` and the logits
``[B, C, V]``, never ``[B, T, T]`` or ``[B, T, V]``, so memory grows linearly with ``L``.
The step is jitted once per (rows, chunk, cache length).

A ``Scorable`` is a model with its text and its limit: ``from_workdir`` (a run: its
validation split; positions other than a learned table extend to any length) or
``from_pretrained`` (a Hugging Face folder: the end of the embedded corpus through the
folder's ``tokenizer.json``; its limit is ``max_position_embeddings``, times the factor of a
``rope_scaling`` given here). Either scores ``text`` instead when one is given, through its
own tokenizer. ``rope_scaling`` ("KIND:FACTOR") stretches RoPE at evaluation time, its
``original_max_len`` the run's training length (a pretrained model's ``max_len``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.config import ModelConfig
from attnlab.errors import ConfigError, PretrainedFileError

MODES = ("chunks", "sliding")
_STEP = {}


@dataclasses.dataclass
class Scorable:
    """A decoder, the token ids it is scored on and the longest length it may be fed."""

    name: str
    cfg: ModelConfig
    state: Any
    ids: np.ndarray | None  # held-out token ids (None: the model has none)
    limit: int | None  # None: any length
    limit_reason: str
    train_len: int | None = None
    encode: Any = None  # text -> ids
    decode: Any = None  # ids -> text


def parse_rope_scaling(spec: str | None, cfg: ModelConfig, original: int) -> dict | None:
    """``"KIND:FACTOR"`` as a ``ModelConfig.rope_scaling`` dict (``original_max_len``:
    ``original``), checked against the model."""
    if spec is None:
        return None
    if cfg.position != "rope":
        raise ConfigError(
            f"--rope-scaling {spec}: the model has position={cfg.position!r}, not rope"
        )
    kind, _, factor = spec.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = -1.0
    if kind not in ("linear", "llama3", "yarn") or not value > 0:
        raise ConfigError(
            f"--rope-scaling {spec!r}: use KIND:FACTOR with KIND linear, llama3 or yarn and a "
            "positive FACTOR, e.g. yarn:8"
        )
    out = {"kind": kind, "factor": value}
    if kind != "linear":
        out["original_max_len"] = int(original)
    return out


def _with_scaling(cfg: ModelConfig, spec, original: int) -> ModelConfig:
    scaling = parse_rope_scaling(spec, cfg, original)
    return cfg if scaling is None else cfg.replace(rope_scaling=scaling)


def from_workdir(
    workdir, step=None, *, rope_scaling: str | None = None, text: str | None = None
) -> Scorable:
    """A run scored on its validation split (or on ``text``, through the run's tokenizer)."""
    from attnlab.runs.loading import load_run
    from attnlab.runs.sampling import decode_known

    run = load_run(workdir, step)
    cfg = run.trainer.mcfg
    if cfg.arch != "decoder" or not cfg.causal:
        raise ConfigError(f"--workdir {workdir}: a {cfg.arch} model; length eval needs a decoder")
    if run.task.tokenizer is None:
        raise ConfigError(
            f"--workdir {workdir} was trained on data.kind={run.task.name!r}, which has no "
            "text tokenizer; --lengths and --tasks score models of text"
        )
    train_len = int(run.config.data.seq_len)
    learned = cfg.position == "learned"
    ids = run.task.val_ids if text is None else run.task.encode(text)
    return Scorable(
        name=str(workdir),
        cfg=_with_scaling(cfg, rope_scaling, train_len),
        state=run.params,
        ids=None if ids is None else np.asarray(ids),
        limit=cfg.max_len if learned else None,
        limit_reason=f"the learned position table of model.max_len={cfg.max_len} rows",
        train_len=train_len,
        encode=lambda text: [int(i) for i in run.task.encode(text)],
        decode=lambda ids: decode_known(run.task, np.asarray(ids, np.int64)),
    )


def from_pretrained(
    path,
    *,
    rope_scaling: str | None = None,
    text: str | None = None,
    dtype="float32",
    max_chars=400_000,
):
    """A Hugging Face folder scored on ``text`` (default: the last ``max_chars`` characters of
    the embedded corpus) through the folder's own ``tokenizer.json``."""
    from attnlab.data.corpus import stdlib_corpus
    from attnlab.pretrained.loader import load_pretrained
    from attnlab.pretrained.text import TOKENIZER_FILE, tokenizer_of

    config, tokenizer = (os.path.join(path, n) for n in ("config.json", TOKENIZER_FILE))
    if os.path.isfile(config) and not os.path.isfile(tokenizer):  # before the weights are read
        raise PretrainedFileError(
            f"--pretrained {path} has no {TOKENIZER_FILE}: --lengths and --tasks encode text "
            "with the checkpoint's tokenizer; download it into the folder"
        )
    handle = load_pretrained(path, dtype=dtype)
    cfg = handle.config
    if cfg.arch != "decoder" or not cfg.causal:
        raise ConfigError(f"--pretrained {path}: a {cfg.arch} model; length eval needs a decoder")
    tok = tokenizer_of(handle)
    text = stdlib_corpus(None)[-max_chars:] if text is None else text
    original = cfg.max_len
    if cfg.rope_scaling is not None and cfg.rope_scaling.original_max_len:
        original = cfg.rope_scaling.original_max_len
    limit, reason = cfg.max_len, f"its max_position_embeddings={cfg.max_len}"
    if rope_scaling is not None:
        scaled = parse_rope_scaling(rope_scaling, cfg, original)
        limit = int(original * scaled["factor"])
        reason = f"{original} x the --rope-scaling factor {scaled['factor']:g} = {limit}"
    return Scorable(
        name=str(path),
        cfg=_with_scaling(cfg, rope_scaling, original),
        state=handle.state,
        ids=np.asarray(tok.encode(text, add_special_tokens=False).ids, np.int64),
        limit=limit,
        limit_reason=reason,
        train_len=original,
        encode=lambda t: tok.encode(t, add_special_tokens=False).ids,
        decode=lambda ids: tok.decode(list(ids), skip_special_tokens=True),
    )


def check_lengths(scorable: Scorable, lengths) -> None:
    """One line naming the first length past the model's limit, before any compute."""
    for n in lengths:
        if not (isinstance(n, int) and n >= 2):
            raise ConfigError(f"--lengths: {n!r} is not a length (an integer >= 2)")
        if scorable.limit is not None and n > scorable.limit:
            raise ConfigError(
                f"--lengths {n} is past {scorable.limit_reason}: {scorable.name} has no "
                f"positions beyond {scorable.limit}; pass lengths up to {scorable.limit}"
            )


def eval_config(scorable: Scorable, longest: int) -> ModelConfig:
    """The scorable's config with positions and caches reaching ``longest`` tokens."""
    cfg = scorable.cfg
    return cfg if cfg.max_len >= longest else cfg.replace(max_len=int(longest))


def merged(cfg: ModelConfig, state):
    """``(graphdef, state)`` of the model ``cfg`` (its max_len or scaling changed) holding
    ``state``."""
    from attnlab.nn.models import MODEL_CLASSES

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: MODEL_CLASSES[cfg.arch](cfg, rngs=nnx.Rngs(0))))
    return graphdef, state


def _score_step(graphdef, state, cache, inputs_BC, targets_BC, mask_BC):
    model = nnx.merge(graphdef, state)
    out = model(inputs_BC, cache=cache)
    logp_BCV = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
    nll_BC = -jnp.take_along_axis(logp_BCV, targets_BC[..., None], axis=-1)[..., 0]
    nll = jnp.where(mask_BC > 0, nll_BC, 0.0).sum()
    return nll, out.cache


def score_step():
    """The jitted ``(graphdef, state, cache, inputs, targets, mask) -> (nll sum, cache)``."""
    if "fn" not in _STEP:
        _STEP["fn"] = jax.jit(_score_step, static_argnums=0, donate_argnums=2)
    return _STEP["fn"]


def chunk_for(length: int, chunk: int) -> int:
    """The largest divisor of ``length`` no longer than ``chunk``."""
    return max(d for d in range(1, min(chunk, length) + 1) if length % d == 0)


def windows(ids, length: int, mode: str, tokens: int, stride: int | None = None):
    """``(starts, first)``: window starts of ``length + 1`` ids and the first scored
    position of each window, for ``tokens`` scored tokens (fewer where the text ends)."""
    room = len(ids) - length - 1
    if room < 0:
        raise ConfigError(
            f"--lengths {length}: the held-out text has {len(ids)} tokens, fewer than one "
            f"window of {length + 1}"
        )
    if mode == "chunks":
        n = max(1, min(tokens // length, room // length + 1))
        return np.arange(n) * length, 0
    stride = stride or max(1, length // 4)
    n = max(1, min(tokens // stride, room // stride + 1))
    return np.arange(n) * stride, length - stride


def score_length(
    graphdef,
    state,
    cfg,
    ids,
    length,
    mode,
    *,
    tokens,
    stride=None,
    chunk=512,
    rows=None,
    progress=False,
) -> dict:
    """Mean loss of the scored tokens of ``length``-token windows in ``mode``."""
    from attnlab.kv_cache import init_cache

    if mode not in MODES:
        raise ConfigError(f"--context-mode {mode!r}: use one of {list(MODES)}")
    starts, first = windows(ids, length, mode, tokens, stride)
    C = chunk_for(length, chunk)
    B = rows or max(1, min(len(starts), 16_384 // length))
    step, nll, counted, began = score_step(), 0.0, 0, time.perf_counter()
    for b0 in range(0, len(starts), B):
        group = starts[b0 : b0 + B]
        seq = np.stack([ids[s : s + length + 1] for s in group]).astype(np.int32)
        mask = np.zeros((B, length), np.float32)
        mask[: len(group), first:] = 1.0
        seq = np.concatenate([seq, np.repeat(seq[:1], B - len(group), 0)])  # rows that fill B
        cache = init_cache(cfg, B, length)
        for c0 in range(0, length, C):
            part, cache = step(
                graphdef,
                state,
                cache,
                jnp.asarray(seq[:, c0 : c0 + C]),
                jnp.asarray(seq[:, c0 + 1 : c0 + C + 1]),
                jnp.asarray(mask[:, c0 : c0 + C]),
            )
            nll += float(part)
        counted += int(mask.sum())
        if progress:
            done = min(b0 + B, len(starts))
            print(
                f"  length {length} {mode}: {done}/{len(starts)} windows, loss {nll / counted:.4f}",
                file=sys.stderr,
                flush=True,
            )
    loss = nll / counted
    return {
        "length": int(length),
        "mode": mode,
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "tokens": counted,
        "windows": int(len(starts)),
        "stride": int(length if mode == "chunks" else length - first),
        "seconds": round(time.perf_counter() - began, 3),
    }


def evaluate_lengths(
    scorable: Scorable,
    lengths,
    *,
    modes=("chunks",),
    tokens=16_384,
    stride=None,
    chunk=512,
    rows=None,
    progress=False,
) -> dict:
    """``{"name", "train_len", "rope_scaling", "limit", "results": [score_length rows]}``."""
    lengths = [int(n) for n in lengths]
    check_lengths(scorable, lengths)
    if scorable.ids is None:
        raise ConfigError(
            f"{scorable.name} has no held-out text (a run on a synthetic task): --lengths alone "
            "scores text; add --tasks to score its tasks"
        )
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"--context-mode {mode!r}: use one of {list(MODES)}")
    cfg = eval_config(scorable, max(lengths))
    graphdef, state = merged(cfg, scorable.state)
    results = []
    for mode in modes:
        for n in lengths:
            row = score_length(
                graphdef,
                state,
                cfg,
                scorable.ids,
                n,
                mode,
                tokens=tokens,
                stride=stride,
                chunk=chunk,
                rows=rows,
                progress=progress,
            )
            results.append(row)
            if progress:
                print(
                    f"{scorable.name}: length {n} {mode}: loss {row['loss']:.4f} "
                    f"({row['tokens']} tokens, {row['seconds']} s)",
                    file=sys.stderr,
                )
    scaling = scorable.cfg.rope_scaling
    return {
        "name": scorable.name,
        "train_len": scorable.train_len,
        "position": scorable.cfg.position,
        "rope_scaling": None if scaling is None else dataclasses.asdict(scaling),
        "limit": scorable.limit,
        "results": results,
    }


def plot_lengths(runs: dict, mode: str, path, *, title=None):
    """Loss against length (log2 axis), one line per entry of ``runs`` ({label: result});
    rows with a ``loss_interval`` (a mean over seeds, ``mean_over_seeds``) get error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    train_lens = set()
    for label, result in runs.items():
        rows = [r for r in result["results"] if r["mode"] == mode]
        if rows:
            x, y = [r["length"] for r in rows], [r["loss"] for r in rows]
            yerr = [r.get("loss_interval", 0.0) for r in rows]
            ax.errorbar(x, y, yerr=yerr if any(yerr) else None, fmt="o-", capsize=2, label=label)
        if result.get("train_len"):
            train_lens.add(result["train_len"])
    for n in train_lens:
        ax.axvline(n, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title or f"loss by length ({mode})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(runs: dict, modes=MODES) -> str:
    """Loss per run (rows) and length (columns), one table per mode; a mean over seeds
    (``mean_over_seeds``) as ``mean ± 95% half-width``."""
    out = []
    for mode in modes:
        lengths = sorted(
            {r["length"] for v in runs.values() for r in v["results"] if r["mode"] == mode}
        )
        if not lengths:
            continue
        out.append(f"{mode}\n\n| run | " + " | ".join(map(str, lengths)) + " |")
        out.append("|---|" + "---|" * len(lengths))
        for label, v in runs.items():
            by = {r["length"]: r for r in v["results"] if r["mode"] == mode}
            cells = [_cell(by[n]) if n in by else "" for n in lengths]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _cell(row) -> str:
    if "loss_interval" in row:
        return f"{row['loss']:.3f} ± {row['loss_interval']:.3f}"
    return f"{row['loss']:.3f}"


def mean_over_seeds(results: list[dict]) -> dict:
    """One ``evaluate_lengths`` result per seed -> the first's, each row's ``loss`` the mean
    over seeds, with ``loss_interval`` (its 95% t-interval half-width), ``loss_per_seed``
    and ``perplexity`` of the mean loss."""
    from attnlab.experiment.harness import interval

    rows = []
    for i, row in enumerate(results[0]["results"]):
        losses = [r["results"][i]["loss"] for r in results]
        if any((r["results"][i]["mode"], r["results"][i]["length"])
               != (row["mode"], row["length"]) for r in results):  # fmt: skip
            raise ValueError("mean_over_seeds: the seeds were scored at different lengths")
        mean, half, _ = interval(losses)
        rows.append(row | {"loss": mean, "perplexity": math.exp(mean), "loss_interval": half,
                           "loss_per_seed": losses})  # fmt: skip
    return results[0] | {"results": rows, "seeds": len(results)}
