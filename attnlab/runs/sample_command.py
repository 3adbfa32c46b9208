"""``attnlab sample``: text from a run's checkpoint or a Hugging Face folder (a command, above
the runs and the pretrained loaders it reads from).

A run's model may sample ids its tokenizer has no text for (``model.vocab_size`` above the
tokenizer's size, as ``char_lm``'s 256 over a corpus of 94 characters): they are left out of
the printed text, and one line on stderr says how many of the sampled ids were.
"""

from __future__ import annotations

import math
import os
import sys

from attnlab.config.architectures import architecture
from attnlab.errors import ConfigError, DecodeError, PretrainedFileError, one_line


def check_sampling(args):
    """Refuses sampling values outside their domain, naming the flag."""
    for flag, value, ok, what in [
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 0, "an integer >= 0"),
        ("--temperature", args.temperature, args.temperature >= 0, "a number >= 0 (0 = greedy)"),
        ("--top-k", args.top_k, args.top_k >= 0, "an integer >= 0 (0 = off)"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "a number in (0, 1] (1 = off)"),
        ("--seed", args.seed, args.seed >= 0, "an integer >= 0"),
    ]:
        if not (math.isfinite(value) and ok):
            raise DecodeError(f"{flag} {value} is invalid: pass {what}")


def _encode(task, text, flag):
    try:
        ids = task.encode(text)
    except ValueError as e:
        raise DecodeError(f"{flag}: {one_line(e)}") from None
    if len(ids) == 0:
        raise DecodeError(f"{flag} is empty: pass some text (it has no tokens)")
    return ids


# Positions read from a table of model.max_len rows: nothing exists past the table.
TABLE_POSITIONS = ("learned", "sinusoidal")


def _room(n, used, max_len, on_overflow, flag, position=None):
    """New tokens that fit after ``used`` ones; overflow raises or stops, as chosen. Models
    whose positions are a table of ``max_len`` rows refuse unless ``--on-overflow stop``
    was asked for."""
    if on_overflow is None:
        on_overflow = "raise" if position in TABLE_POSITIONS else "stop"
    room = max_len - used
    if room < 0:
        raise DecodeError(
            f"{flag} has {used} tokens, more than model.max_len={max_len}: shorten it"
        )
    if n <= room:
        return n
    if on_overflow == "raise":
        table = (
            f" (model.position={position!r} has no position past its {max_len} rows)"
            if position in TABLE_POSITIONS
            else ""
        )
        raise DecodeError(
            f"{flag} ({used} tokens) + --max-new-tokens {n} exceeds the context limit "
            f"model.max_len={max_len}{table}: pass --max-new-tokens {room} or less, or "
            "--on-overflow stop"
        )
    print(
        f"attnlab sample: stopping at the context limit: model.max_len={max_len} leaves room "
        f"for {room} new tokens after {used} tokens of {flag}",
        file=sys.stderr,
    )
    return room


def _sample(args, overrides):
    from attnlab import runs

    check_sampling(args)
    if args.pretrained:
        return _sample_pretrained(args)
    if args.workdir is None:
        raise ConfigError("attnlab sample: pass --workdir DIR (a run) or --pretrained DIR")
    run = runs.load_run(args.workdir, args.step)
    cfg, trainer, task, model = run.config, run.trainer, run.task, run.model
    max_len = trainer.mcfg.max_len
    common = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if architecture(trainer.mcfg).seq2seq:
        if args.source is None:
            raise DecodeError('this run is an encoder-decoder model: pass --source "..."')
        position = trainer.mcfg.position
        _room(0, len(_encode(task, args.source, "--source")), max_len, "raise", "--source")
        n = _room(args.max_new_tokens, 1, max_len, args.on_overflow, "the start token", position)
        tokens = runs.seq2seq_continuation(model, task, args.source, n, **common)
        print(runs.decode_known(task, tokens))
        _say_unknown(task, tokens, trainer.mcfg.vocab_size)
        return
    if not architecture(trainer.mcfg).generates:
        raise DecodeError(
            f"{args.workdir} holds an {trainer.mcfg.arch} model: sampling needs a decoder-only "
            "or encoder-decoder run"
        )
    prompt = args.prompt[0] if args.prompt else runs.default_prompt(cfg, task)
    ids = _encode(task, prompt, "--prompt")
    n = _room(
        args.max_new_tokens, len(ids), max_len, args.on_overflow, "--prompt", trainer.mcfg.position
    )
    eos = getattr(task, "eos_id", None) if task.tokenizer is None else None
    tokens = runs.continuation(model, ids, n, eos_id=eos, **common)
    print(prompt + runs.decode_known(task, tokens))
    _say_unknown(task, tokens, trainer.mcfg.vocab_size)


def _say_unknown(task, tokens, model_vocab):
    """One stderr line when sampled ids had no text (they are left out of the text)."""
    from attnlab.runs.sampling import unknown_ids

    n = unknown_ids(task, tokens)
    if n:
        print(
            f"attnlab sample: {n} of the {len(tokens)} sampled ids have no text and are left "
            f"out: the tokenizer knows ids 0-{task.vocab_size - 1}, the model samples from "
            f"model.vocab_size={model_vocab} (train longer, or set model.vocab_size to "
            f"{task.vocab_size})",
            file=sys.stderr,
            flush=True,
        )


def _sample_pretrained(args):
    from attnlab.pretrained import load_pretrained

    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    prompts = args.prompt or [""]
    if os.path.isdir(args.pretrained) and not os.path.isfile(
        os.path.join(args.pretrained, "tokenizer.json")
    ):  # before the weights are read
        raise PretrainedFileError(
            f"--pretrained {args.pretrained} has no tokenizer.json: text generation needs the "
            "checkpoint's tokenizer; download it into the folder"
        )
    handle = load_pretrained(args.pretrained)
    for prompt, text in zip(
        prompts, handle.generate_text(prompts, args.max_new_tokens, **options), strict=True
    ):
        print(prompt + text)


def add_parser(sub, parents) -> None:
    """Adds ``sample`` to the ``attnlab`` subcommands (``parents``: the shared flags)."""
    s = sub.add_parser(
        "sample", parents=parents, help="sample from a run's checkpoint or a HF folder"
    )
    s.add_argument("--workdir", default=None)
    s.add_argument("--pretrained", default=None, help="a Hugging Face folder with tokenizer.json")
    s.add_argument(
        "--prompt",
        default=None,
        action="append",
        help="default: the run's eval.sample_prompt; repeat for several prompts (--pretrained)",
    )
    s.add_argument("--source", default=None, help="source text for encoder-decoder runs")
    s.add_argument("--max-new-tokens", type=int, default=200)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--on-overflow",
        choices=("stop", "raise"),
        default=None,
        help="stop at the model's context limit or refuse to start (default: stop, or raise "
        "for learned and sinusoidal positions, which have nothing past model.max_len)",
    )
    s.set_defaults(fn=_sample)
