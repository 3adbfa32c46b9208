"""Text from a run's model: the one place the training side calls the decoders.

``continuation`` serves the training loop's samples and ``attnlab sample`` through
``attnlab.generate`` (the cached decoder; full recomputation for the causal-mask ablation,
which the cache cannot serve). ``seq2seq_continuation`` serves encoder-decoder runs.
Sampled ids beyond the task's vocabulary have no text and are dropped.
"""

from __future__ import annotations

import numpy as np

from attnlab.errors import ConfigError, one_line


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
    the task's vocabulary, and such ids have no text; ``unknown_ids`` counts them)."""
    tokens = np.asarray(tokens)
    return task.decode(tokens[(tokens >= 0) & (tokens < task.vocab_size)])


def unknown_ids(task, tokens) -> int:
    """How many of the sampled ``tokens`` the tokenizer has no text for (``decode_known``
    leaves them out)."""
    tokens = np.asarray(tokens)
    return int(((tokens < 0) | (tokens >= task.vocab_size)).sum())


def default_prompt(cfg, task) -> str:
    """The run's sample prompt: ``eval.sample_prompt``, else the validation text's first token."""
    if cfg.eval.sample_prompt:
        return cfg.eval.sample_prompt
    return task.decode(task.val_ids[:1]) if task.val_ids is not None else ""


def sample_plan(kind, task, cfg, max_len):
    """``(prompt, ids, n)`` of the samples a run logs at its evaluations (``n`` new tokens
    after the prompt's ``ids``), None when it logs none (not a language model, no
    tokenizer, ``eval.sample_tokens`` 0). A prompt the tokenizer cannot encode, or one that
    leaves no room in ``model.max_len``, is a ``ConfigError`` (checked before the first
    step by ``attnlab.runs.preflight``)."""
    if kind != "lm" or task.tokenizer is None or cfg.eval.sample_tokens <= 0:
        return None
    prompt = default_prompt(cfg, task)
    fix = "or set --config.eval.sample_tokens=0 for no samples"
    try:
        ids = task.encode(prompt)
    except ValueError as e:
        raise ConfigError(
            f"eval.sample_prompt={prompt!r} cannot be encoded: {one_line(e)}; set "
            f"--config.eval.sample_prompt=TEXT with characters the tokenizer knows, {fix}"
        ) from None
    room = max_len - len(ids)
    if len(ids) == 0 or room <= 0:
        raise ConfigError(
            f"eval.sample_prompt={prompt!r} has {len(ids)} tokens: samples need 1 to "
            f"{max_len - 1} (model.max_len={max_len}); change it, {fix}"
        )
    return prompt, ids, min(int(cfg.eval.sample_tokens), room)


def sample_text(trainer, task, params, cfg, step):
    """A short sample from a language model (None for other tasks); unknown ids are dropped."""
    plan = sample_plan(trainer.kind, task, cfg, trainer.mcfg.max_len)
    if plan is None:
        return None
    prompt, ids, n = plan
    seed = int(cfg.train.seed) * 1_000_003 + step
    options = dict(temperature=float(cfg.eval.sample_temperature), seed=seed)
    return prompt + decode_known(task, continuation(trainer.model(params), ids, n, **options))
