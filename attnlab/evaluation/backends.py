"""What the harness needs of a model, from a run's work directory or a Hugging Face folder.

A ``Backend`` holds a decoder-only model split once (``graphdef``, ``state``), its text
encoding, the id that conditions an empty context (``prefix_id``) and the end-of-text id
(None where the tokenizer has none). ``scores`` runs the causal forward pass on right-padded
rows, jitted once per (rows, width): widths are rounded up to powers of two, rows to the
batch size, so a task compiles a handful of programs. ``generate`` is ``attnlab.generate``,
the KV-cache decoder, on a batch of prompts.

A run's tokenizer (char, byte or a trained BPE) has no BOS: an empty context is conditioned
on the id of a newline (id 0 where the vocabulary has no newline).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab.decode.api import bucket
from attnlab.errors import ConfigError

_FORWARD = {}


@dataclasses.dataclass
class Backend:
    """A decoder-only model and its tokenizer, as the harness adapter uses them."""

    name: str
    model: Any  # what ``attnlab.generate`` takes (an NNX model or a ``Pretrained``)
    graphdef: Any
    state: Any
    max_len: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    prefix_id: int
    eos_id: int | None

    def log_probs(self, tokens_BT) -> np.ndarray:
        """Float32 log-probabilities ``[B, T, V]`` of the next token after each position."""
        if "fn" not in _FORWARD:
            _FORWARD["fn"] = jax.jit(
                lambda g, s, t: jax.nn.log_softmax(nnx.merge(g, s)(t).logits, axis=-1),
                static_argnums=0,
            )
        return np.asarray(_FORWARD["fn"](self.graphdef, self.state, jnp.asarray(tokens_BT)))

    def scores(self, rows, batch_size: int) -> list[tuple[float, bool]]:
        """(sum of log-probs, greedy?) of the last ``n`` tokens of each ``(ids, n)`` row,
        each predicted from the ids before it; rows are cut to their last ``max_len + 1``."""
        out = []
        for first in range(0, len(rows), batch_size):
            chunk = [
                (ids[-(self.max_len + 1) :], min(n, len(ids) - 1, self.max_len))
                for ids, n in rows[first : first + batch_size]
            ]
            width = bucket(max(len(ids) - 1 for ids, _ in chunk), self.max_len)
            tokens = np.zeros((batch_size, width), np.int32)
            for r, (ids, _) in enumerate(chunk):
                tokens[r, : len(ids) - 1] = ids[:-1]
            logp = self.log_probs(tokens)
            for r, (ids, n) in enumerate(chunk):
                last = len(ids) - 1
                target = np.asarray(ids[last + 1 - n :])
                rows_logp = logp[r, last - n : last]
                picked = rows_logp[np.arange(n), target]
                out.append((float(picked.sum()), bool((rows_logp.argmax(-1) == target).all())))
        return out

    def generate(self, prompts, max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations (new ids only) of ``prompts`` (lists of ids), in one batch."""
        from attnlab.decode import generate

        lengths = np.array([len(p) for p in prompts])
        ids = np.zeros((len(prompts), int(lengths.max())), np.int32)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = p
        result = generate(
            self.model,
            ids,
            max_new_tokens,
            prompt_lengths=lengths,
            eos_id=self.eos_id,
            on_overflow="stop",
        )
        return [result.tokens[r, : result.lengths[r]].tolist() for r in range(len(prompts))]


def _decoder_only(cfg, what):
    if cfg.arch != "decoder" or not cfg.causal:
        raise ConfigError(
            f"{what} is a {cfg.arch} model (causal={cfg.causal}): the harness scores "
            "causal decoder-only language models"
        )


def from_run(workdir, step: int | None = None) -> Backend:
    """The backend of checkpoint ``step`` (default: the newest) of a run."""
    from attnlab.runs.loading import load_run
    from attnlab.runs.sampling import decode_known

    run = load_run(workdir, step)
    cfg = run.trainer.mcfg
    _decoder_only(cfg, f"--workdir {workdir}")
    if run.task.tokenizer is None:
        raise ConfigError(
            f"--workdir {workdir} was trained on data.kind={run.task.name!r}, which has no "
            "text tokenizer: the harness scores text"
        )
    return for_model(
        f"attnlab:{workdir}@{run.step}",
        run.model,
        encode=run.task.encode,
        decode=lambda ids: decode_known(run.task, np.asarray(ids, np.int64)),
    )


def for_model(name: str, model, *, encode, decode) -> Backend:
    """The backend of an NNX decoder and its text tokenizer's ``encode`` / ``decode`` (an
    empty context is conditioned on the newline's last id)."""
    graphdef, state = nnx.split(model)
    try:
        newline = int(encode("\n")[-1])
    except (ValueError, IndexError):
        newline = 0
    return Backend(
        name=name,
        model=model,
        graphdef=graphdef,
        state=state,
        max_len=model.cfg.max_len,
        encode=lambda text: [int(i) for i in encode(text)],
        decode=decode,
        prefix_id=newline,
        eos_id=None,
    )


def from_pretrained(path, dtype: str = "float32") -> Backend:
    """The backend of a Hugging Face checkpoint folder with its ``tokenizer.json``."""
    from attnlab.pretrained.loader import load_pretrained
    from attnlab.pretrained.text import tokenizer_of

    handle = load_pretrained(path, dtype=dtype)
    _decoder_only(handle.config, f"--pretrained {path}")
    tok = tokenizer_of(handle)
    prefix = handle.bos_id if handle.bos_id is not None else handle.eos_id
    return Backend(
        name=f"attnlab:{path}",
        model=handle,
        graphdef=handle.graphdef,
        state=handle.state,
        max_len=handle.config.max_len,
        encode=lambda text: tok.encode(text, add_special_tokens=False).ids,
        decode=lambda ids: tok.decode(list(ids), skip_special_tokens=True),
        prefix_id=0 if prefix is None else int(prefix),
        eos_id=handle.eos_id,
    )
