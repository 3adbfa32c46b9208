"""``attnlab eval --lengths ... [--tasks ...]``: loss by length and RULER-style tasks by length.

``--lengths 128,256,...`` alone writes ``length_eval.json`` and ``length_eval.png`` (loss
against length per ``--context-mode``); with ``--tasks a,b`` it writes ``tasks.json`` and
``tasks.png`` (accuracy per task and length, the effective length) instead. The model is
``--workdir`` (scored on its validation split) or ``--pretrained`` (a Hugging Face folder,
scored on the end of the embedded corpus through the folder's tokenizer); ``--text FILE``
scores that file's text instead, through the model's tokenizer. ``--workdir`` may name
several runs, comma-separated (a directory whose own name holds a comma is one run): one
line per run in the plot. Files go to ``--out`` (default: the one run's directory, else the
working directory). ``--write-harness DIR`` writes the tasks as an lm-eval task folder
instead (``attnlab.evaluation.ruler_harness``).
"""

from __future__ import annotations

import json
import pathlib
import sys

from attnlab.errors import ConfigError, DataFileError, one_line


def add_flags(e) -> None:
    """Adds the length flags to the ``attnlab eval`` parser ``e``."""
    e.add_argument(
        "--lengths",
        default=None,
        metavar="L1,L2,...",
        help="loss (or --tasks accuracy) at each evaluation length, in tokens",
    )
    e.add_argument(
        "--context-mode",
        default="chunks",
        metavar="chunks|sliding|both",
        help="non-overlapping windows, a sliding window (--stride), or both",
    )
    e.add_argument("--stride", type=int, default=None, help="sliding: scored tokens per window")
    e.add_argument(
        "--rope-scaling",
        default=None,
        metavar="KIND:FACTOR",
        help="stretch RoPE at evaluation time: linear (Position Interpolation), yarn, llama3",
    )
    e.add_argument("--tokens", type=int, default=16_384, help="--lengths: tokens scored per length")
    e.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="--lengths: score this UTF-8 text file, through the model's tokenizer (default: "
        "a run's validation split, a --pretrained folder's end of the embedded corpus)",
    )
    e.add_argument(
        "--tasks",
        default=None,
        metavar="T1,T2|all",
        help="RULER-style tasks scored at each of --lengths (attnlab.data.ruler_tasks)",
    )
    e.add_argument("--examples", type=int, default=32, help="--tasks: examples per task and length")
    e.add_argument("--seed", type=int, default=0, help="--tasks: the examples' seed")
    e.add_argument("--threshold", type=float, default=0.856, help="--tasks: effective length's")
    e.add_argument("--out", default=None, metavar="DIR", help="where the JSON and PNG go")
    e.add_argument(
        "--write-harness", default=None, metavar="DIR",
        help="write --tasks at --lengths as an lm-eval task folder (the model's tokenizer, "
        "else bytes) instead of scoring them",
    )  # fmt: skip


def wanted(args) -> bool:
    flags = ("lengths", "tasks", "write_harness", "text")
    return any(getattr(args, f, None) is not None for f in flags)


def write_harness(args) -> None:
    """``--write-harness DIR``: the task folder, lengths in the model's tokens (or bytes)."""
    from attnlab.evaluation.ruler_harness import TAG, write_tasks

    if args.tasks is None or args.lengths is None:
        raise ConfigError("--write-harness DIR needs --tasks T1,T2 and --lengths L1,L2")
    if args.workdir is None and args.pretrained is None:
        from attnlab.data.tokenizers import ByteTokenizer

        tok = ByteTokenizer()
        encode, decode = (lambda t: [int(i) for i in tok.encode(t)]), tok.decode
    else:
        s = _scorables(args)[0]
        encode, decode = s.encode, s.decode
    names = write_tasks(args.write_harness, args.tasks, _lengths(args.lengths), encode, decode,
                        examples=args.examples, seed=args.seed)  # fmt: skip
    print(f"{args.write_harness}: {len(names)} tasks tagged {TAG}", file=sys.stderr)
    print(args.write_harness)


def _lengths(spec) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 2:
        raise ConfigError(f"--lengths {spec!r}: a comma-separated list of lengths >= 2")
    return out


def _modes(spec) -> tuple[str, ...]:
    modes = ("chunks", "sliding") if spec == "both" else (spec,)
    from attnlab.evaluation.length import MODES

    if any(m not in MODES for m in modes):
        raise ConfigError(f"--context-mode {spec!r}: use chunks, sliding or both")
    return modes


def _text(args) -> str | None:
    """The ``--text`` file's contents (None without one), read before any model loads."""
    if args.text is None:
        return None
    try:
        return pathlib.Path(args.text).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataFileError(f"--text {args.text}: no such file; pass a UTF-8 text file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(f"--text {args.text}: not UTF-8 text ({one_line(e)})") from None


def _scorables(args):
    from attnlab.evaluation import length

    text = _text(args)
    if args.pretrained is not None:
        if args.workdir is not None:
            raise ConfigError("--lengths scores --workdir RUN or --pretrained DIR, not both")
        if args.step is not None:
            raise ConfigError("--step picks a run's checkpoint; a --pretrained folder has one")
        return [length.from_pretrained(args.pretrained, rope_scaling=args.rope_scaling, text=text)]
    if args.workdir is None:
        raise ConfigError("--lengths needs --workdir RUN[,RUN...] or --pretrained DIR")
    whole = pathlib.Path(args.workdir).is_dir()  # a sweep's trial names hold commas
    dirs = [args.workdir] if whole else [d for d in args.workdir.split(",") if d]
    return [
        length.from_workdir(d, args.step, rope_scaling=args.rope_scaling, text=text) for d in dirs
    ]


def run(args) -> None:
    """Writes the JSON and PNG, prints the JSON's path and a one-line summary per run."""
    from attnlab.evaluation import length

    if args.harness is not None or args.full:
        raise ConfigError("--lengths and --tasks stand alone: drop --harness / --full")
    if args.text is not None and (args.tasks is not None or args.write_harness is not None):
        raise ConfigError("--text is the text --lengths scores; --tasks draw their own: drop one")
    if args.write_harness is not None:
        return write_harness(args)
    if args.lengths is None:
        raise ConfigError(
            f"{'--tasks' if args.text is None else '--text'} needs --lengths L1,L2,..."
        )
    lengths, modes = _lengths(args.lengths), _modes(args.context_mode)
    scorables = _scorables(args)
    for s in scorables:  # every limit before any compute
        length.check_lengths(s, lengths)
    out = pathlib.Path(args.out or (args.workdir if len(scorables) == 1 and args.workdir else "."))
    out.mkdir(parents=True, exist_ok=True)
    if args.tasks is not None:
        from attnlab.evaluation import ruler

        results = {
            s.name: ruler.evaluate_tasks(
                s,
                args.tasks,
                lengths,
                examples=args.examples,
                seed=args.seed,
                threshold=args.threshold,
                progress=True,
            )
            for s in scorables
        }
        path = out / "tasks.json"
        path.write_text(json.dumps(results, indent=1))
        for name, r in results.items():
            suffix = "" if len(results) == 1 else f"_{pathlib.Path(name).name}"
            ruler.plot_heatmap(r, out / f"tasks{suffix}.png", title=name)
            print(f"{name}: effective length {r['effective_length']}", file=sys.stderr)
        print(path)
        return
    results = {
        s.name: length.evaluate_lengths(
            s, lengths, modes=modes, tokens=args.tokens, stride=args.stride, progress=True
        )
        for s in scorables
    }
    path = out / "length_eval.json"
    path.write_text(json.dumps(results, indent=1))
    for mode in modes:
        name = "length_eval.png" if len(modes) == 1 else f"length_eval_{mode}.png"
        length.plot_lengths(results, mode, out / name)
    print(path)
