"""``attnlab eval --harness TASKS``: the flags ``attnlab eval`` gains, and what they run."""

from __future__ import annotations

import json

from attnlab.errors import ConfigError, require


def add_flags(e) -> None:
    """Adds the harness flags to the ``attnlab eval`` parser ``e``."""
    e.add_argument(
        "--harness",
        default=None,
        metavar="TASKS",
        help="comma-separated lm-eval tasks to score the model on (the `eval` extra)",
    )
    e.add_argument(
        "--pretrained",
        default=None,
        metavar="DIR",
        help="a Hugging Face folder (with --harness, or --lengths and --tasks)",
    )
    e.add_argument("--include-path", default=None, help="a folder of task YAML files")
    e.add_argument("--limit", type=float, default=None, help="examples per task (or a fraction)")
    e.add_argument("--num-fewshot", type=int, default=None)
    e.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    e.add_argument(
        "--bootstrap-iters",
        type=int,
        default=100_000,
        help="resamples for the standard errors lm-eval bootstraps (its default; 0: none)",
    )


def check(args) -> None:
    """Refuses flag combinations that mean nothing, naming the flag."""
    if args.harness is None:
        if args.pretrained is not None:
            raise ConfigError(
                "--pretrained is scored by --harness TASKS or --lengths L1,L2: add one"
            )
        if args.workdir is None:
            raise ConfigError("attnlab eval needs --workdir DIR (a run that `attnlab train` wrote)")
        return
    if (args.workdir is None) == (args.pretrained is None):
        raise ConfigError("--harness scores one model: pass --workdir RUN or --pretrained DIR")
    if args.full:
        raise ConfigError("--full evaluates the validation split, not --harness tasks: drop one")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    if args.bootstrap_iters < 0:
        raise ConfigError(f"--bootstrap-iters {args.bootstrap_iters} must be >= 0")
    require("lm_eval", "eval", "--harness (the EleutherAI harness)")  # before a model loads


def harness(args) -> None:
    """Prints the harness's results as one JSON line."""
    from attnlab.evaluation.backends import from_pretrained, from_run
    from attnlab.evaluation.harness import run_harness

    if args.pretrained is not None:
        if args.step is not None:
            raise ConfigError("--step picks a run's checkpoint; a --pretrained folder has one")
        backend = from_pretrained(args.pretrained)
    else:
        backend = from_run(args.workdir, args.step)
    limit = args.limit if args.limit is None or args.limit < 1 else int(args.limit)
    out = run_harness(
        backend,
        args.harness,
        include_path=args.include_path,
        limit=limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        bootstrap_iters=args.bootstrap_iters,
    )
    print(json.dumps(out, default=str))
