"""Text from a run's model: the one place the training side calls the decoders.

``continuation`` serves the training loop's samples and ``attnlab sample`` through
``attnlab.generate`` (the cached decoder; full recomputation for the causal-mask ablation,
which the cache cannot serve). ``seq2seq_continuation`` serves encoder-decoder runs.
Sampled ids beyond the task's vocabulary have no text and are dropped.
"""

from __future__ import annotations

import numpy as np


def continuation(model, ids_P, n: int, *, eos_id=None, **options) -> np.ndarray:
    """``[N]`` new ids after the prompt ``ids_P`` of a decoder-only model (pad after EOS).

    ``options`` are the sampling options of ``attnlab.generate`` (``temperature``,
    ``seed``, ``top_k``, ``top_p``); a model with ``causal=False`` is served by full
    recomputation, which ``generate`` chooses by itself.
    """
    from attnlab.decode import generate

    result = generate(model, np.asarray(ids_P)[None, :], n, eos_id=eos_id, **options)
    return np.asarray(result.tokens[0, : result.lengths[0]])


def seq2seq_continuation(model, task, source: str, n: int, **options) -> np.ndarray:
    """``[N]`` target ids an encoder-decoder model writes for the ``source`` text."""
    from attnlab.decode import generate

    src = task.encode(source)
    result = generate(
        model,
        src[None, :],
        n,
        start_id=task.bos_id,
        eos_id=task.eos_id,
        pad_id=task.pad_id,
        **options,
    )
    return np.asarray(result.tokens[0, : result.lengths[0]])


def decode_known(task, tokens) -> str:
    """Text of sampled ids, dropping ids the tokenizer lacks (``model.vocab_size`` may exceed
    the task's vocabulary, and such ids have no text)."""
    tokens = np.asarray(tokens)
    return task.decode(tokens[(tokens >= 0) & (tokens < task.vocab_size)])


def default_prompt(cfg, task) -> str:
    """The run's sample prompt: ``eval.sample_prompt``, else the validation text's first token."""
    if cfg.eval.sample_prompt:
        return cfg.eval.sample_prompt
    return task.decode(task.val_ids[:1]) if task.val_ids is not None else ""


def sample_text(trainer, task, params, cfg, step):
    """A short sample from a language model (None for other tasks); unknown ids are dropped."""
    if trainer.kind != "lm" or task.tokenizer is None or cfg.eval.sample_tokens <= 0:
        return None
    prompt = default_prompt(cfg, task)
    ids = task.encode(prompt)
    room = trainer.mcfg.max_len - len(ids)
    n = min(int(cfg.eval.sample_tokens), room)
    if n <= 0:
        return None
    seed = int(cfg.train.seed) * 1_000_003 + step
    options = dict(temperature=float(cfg.eval.sample_temperature), seed=seed)
    return prompt + decode_known(task, continuation(trainer.model(params), ids, n, **options))
