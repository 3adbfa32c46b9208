"""The ``attnlab`` command: train, eval, plot, sample, sweep.

attnlab train --config experiments/NAME.py[:tiny] [--config.a.b=v ...] --workdir DIR
              [--step N] [--allow-changes] [--extend] [--verbose] [--import my_variant.py ...]
attnlab sweep --config experiments/NAME.py[:tiny] [--config.a.b=v ...] --workdir DIR
              [--parallel vmap|sequential] [--max-trials N] [--print-commands]
              [--retry-failed] [--allow-changes]
attnlab sweep --collect DIR
attnlab eval --workdir DIR [--step N] [--full] [--import my_variant.py ...]
attnlab eval --harness TASKS (--workdir DIR | --pretrained HF_DIR) [--include-path DIR]
attnlab eval (--workdir DIR | --pretrained HF_DIR) --lengths L1,L2
             [--context-mode chunks|sliding|both] [--rope-scaling KIND:FACTOR]
             [--text FILE | --tasks T1,T2] [--out DIR]
attnlab plot DIR [DIR ...] [--out loss.png]
attnlab sample --workdir DIR [--prompt "..."] [--max-new-tokens N] [--on-overflow stop|raise]
               [--temperature T ...] [--step N]
attnlab sample --pretrained HF_DIR --prompt "..." [--prompt "..."] --max-new-tokens N
attnlab data prepare FILES_OR_GLOBS... --out DIR [--tokenizer bpe|byte|char|PATH]
attnlab data fetch shakespeare | URL --sha256 HASH
attnlab lower --config experiments/NAME.py[:tiny] --platform cuda|tpu [--mesh data=2,fsdp=4]
attnlab sweep ... --launcher local|slurm [--partition P --timeout-min M ...]

Expected errors (config, data, work directory, checkpoint, decoding, pretrained folders,
downloads) print one line and exit with 2 (what was asked cannot run) or 1 (the run failed:
it diverged, a checkpoint is unreadable, the disk is full). A run stopped by SIGINT or SIGTERM
writes its checkpoint, says so in one line and exits with 130 or 143; SIGINT while the command
is still starting (loading JAX) is one line and 130 too. A run that cannot start leaves its
work directory as it was (``attnlab.runs.preflight``). --debug or
ATTNLAB_DEBUG=1 shows the traceback, and the libraries' own warnings and log lines (Orbax,
absl, asyncio), which are hidden otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import warnings

from attnlab.errors import (
    AttnlabError,
    Interrupted,
    WorkdirError,
    one_line,
)


def _train(args, overrides):
    from attnlab import devices, experiment, runs
    from attnlab.devices import sharding
    from attnlab.runs.checkpoint import raise_if_stopped

    cfg = experiment.load_config(args.config, overrides, imports=args.imports or ())
    devices.apply(devices.choose(cfg))  # before anything else uses JAX
    sharding.initialize_distributed(cfg.distributed)
    from attnlab.devices import processes

    try:
        record = runs.train(  # logs its records itself
            cfg,
            args.workdir,
            progress=not args.no_progress,
            step=args.step,
            allow_changes=args.allow_changes,
            verbose=args.verbose,
            extend=args.extend,
        )
    except AttnlabError:  # every process meets it alike: no one waits for this one
        processes.finished()
        raise
    processes.finished()
    raise_if_stopped(f"at step {record.get('step')}; its checkpoint is written in {args.workdir}")


def _eval(args, overrides):
    from attnlab import runs
    from attnlab.evaluation import commands, length_command

    if length_command.wanted(args):
        return length_command.run(args)
    commands.check(args)
    if args.harness is not None:
        return commands.harness(args)
    print(json.dumps(runs.evaluate(args.workdir, args.step, full=args.full)))


def _plot(args, overrides):
    from attnlab import viz

    out = args.out or str(pathlib.Path(args.dirs[0]) / "loss.png")
    try:
        viz.save_loss_curves(args.dirs, out)
    except FileNotFoundError as e:
        raise WorkdirError(f"{one_line(e)}; pass directories that `attnlab train` wrote") from None
    print(out)


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line, with the code of other usage errors (2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="attnlab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    step = argparse.ArgumentParser(add_help=False)  # the flags of commands that read a run
    step.add_argument("--step", type=int, default=None, help="the checkpoint step to use")
    step.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="FILE.py",
        help="import this module file first (a variant it registers); repeatable. train "
        "records it in config.json, so eval and sample import it again by themselves",
    )

    t = sub.add_parser(
        "train", parents=[debug, step], help="train (or resume) an experiment in a work directory"
    )
    t.add_argument(
        "--config", required=True, help="experiments/NAME.py[:variant] or a saved DIR/config.json"
    )
    t.add_argument("--workdir", required=True)
    t.add_argument("--no-progress", action="store_true", help="plain log lines only")
    t.add_argument(
        "--verbose",
        action="store_true",
        help="also print how the state is sharded and which attention paths fall back",
    )
    t.add_argument(
        "--allow-changes",
        action="store_true",
        help="resume with changed optim/train values (applied from the resumed step on)",
    )
    t.add_argument(
        "--extend",
        action="store_true",
        help="resume with a changed train.steps, the learning-rate schedule carrying on from "
        "the resumed step with its shape stretched to the new end (not rebuilt)",
    )
    t.set_defaults(fn=_train, overrides=True)

    e = sub.add_parser(
        "eval", parents=[debug, step], help="evaluate the latest checkpoint on the validation split"
    )
    e.add_argument("--workdir", default=None)
    e.add_argument(
        "--full",
        action="store_true",
        help="every token of the validation split once (non-overlapping context windows)",
    )
    from attnlab.evaluation.commands import add_flags as add_harness_flags

    add_harness_flags(e)
    from attnlab.evaluation.length_command import add_flags as add_length_flags

    add_length_flags(e)
    e.set_defaults(fn=_eval)

    pl = sub.add_parser(
        "plot", parents=[debug], help="PNG of train/eval loss curves of one or more runs"
    )
    pl.add_argument("dirs", nargs="+")
    pl.add_argument("--out", default=None, help="output PNG (default: FIRST_DIR/loss.png)")
    pl.set_defaults(fn=_plot)

    from attnlab.data.commands import add_parser as add_data_parser
    from attnlab.runs.export import add_parser as add_export_parser
    from attnlab.runs.lowering import add_parser as add_lower_parser
    from attnlab.runs.sample_command import add_parser as add_sample_parser
    from attnlab.sweep.command_line import add_parser as add_sweep_parser
    from attnlab.sweep.coord_check import add_parser as add_coord_check_parser
    from attnlab.sweep.report import add_parser as add_report_parser

    add_sample_parser(sub, [debug, step])
    add_export_parser(sub, [debug, step])
    add_lower_parser(sub, [debug])
    add_sweep_parser(sub, [debug])
    add_report_parser(sub, [debug])
    add_coord_check_parser(sub, [debug])
    add_data_parser(sub)
    return p


def compilation_cache():
    """JAX's persistent compilation cache for CLI runs, so a second run of a config starts
    its first step in seconds: in the user's cache directory by default,
    ``ATTNLAB_COMPILATION_CACHE=DIR`` puts it elsewhere and ``=off`` turns it off."""
    from attnlab.compilation import compilation_cache

    return compilation_cache()


def debugging(args=None) -> bool:
    """Whether tracebacks and the libraries' own log lines are wanted."""
    return bool(getattr(args, "debug", False)) or os.environ.get("ATTNLAB_DEBUG") == "1"


@contextlib.contextmanager
def quiet_libraries():
    """Keeps what the libraries log for their developers (Orbax and absl log lines, asyncio's
    "exception was never retrieved", exceptions a library's thread could not raise) off the
    terminal while a command runs: the errors that matter reach ``main`` as exceptions."""
    loggers = [logging.getLogger(n) for n in ("absl", "asyncio", "orbax", "tensorstore")]
    levels = [lg.level for lg in loggers]
    hook = sys.unraisablehook
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(orbax|absl|tensorstore)(\.|$)")
        for lg in loggers:
            lg.setLevel(logging.CRITICAL + 1)
        sys.unraisablehook = lambda unraisable: None
        try:
            yield
        finally:
            sys.unraisablehook = hook
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


class _Terminated(BaseException):
    """SIGTERM outside a training loop (which handles it itself)."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv=None) -> int:
    """The ``attnlab`` command, its console entry point (``[project.scripts]``).

    An interrupt at any point after Python's own start is one line on stderr and exit 130,
    never a traceback. While the subcommands' modules load (JAX, Flax and Orbax among them)
    SIGINT is held until they are loaded: a ``KeyboardInterrupt`` raised inside an
    extension module's initialisation can crash the interpreter (jaxlib's does).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("ATTNLAB_DEBUG") == "1"
    try:
        with _holding_sigint() as held:
            parser = build_parser()
        if held:
            raise KeyboardInterrupt
        return _main(parser, argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print(
            "attnlab: stopped: SIGINT arrived while the command was starting; nothing was done",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(signal.SIGINT)


@contextlib.contextmanager
def _holding_sigint():
    """SIGINT recorded (in the list it yields), not raised, inside the block; the hold
    ``import attnlab`` began for the command (``attnlab._EARLY_SIGINT``) is taken over, with
    what it recorded, and ends here."""
    import attnlab

    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    early, attnlab._EARLY_SIGINT = attnlab._EARLY_SIGINT, None
    if early is not None:
        held, previous = early, signal.default_int_handler
    else:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)


def _main(parser, argv) -> int:
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if a.startswith("--config.")]
    unknown = [a for a in extra if not a.startswith("--config.")]
    if unknown or (overrides and not getattr(args, "overrides", False)):
        parser.error(f"unrecognised arguments: {' '.join(unknown or overrides)}")
    command = " ".join(filter(None, [args.command, getattr(args, "data_command", None)]))
    debug = debugging(args)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        from attnlab.runs import checkpoint

        checkpoint._RECEIVED.clear()
        with contextlib.nullcontext() if debug else quiet_libraries():
            compilation_cache()
            for path in getattr(args, "imports", None) or ():
                from attnlab.experiment import import_file

                import_file(path)  # before anything reads a config that names its variants
            status = args.fn(args, overrides)
    except AttnlabError as e:
        if debug and not isinstance(e, Interrupted):
            raise
        print(f"attnlab {command}: {e.label}: {one_line(e)}", file=sys.stderr, flush=True)
        return e.exit_code
    except (KeyboardInterrupt, _Terminated) as e:
        if debug and isinstance(e, KeyboardInterrupt):
            raise
        name = "SIGINT" if isinstance(e, KeyboardInterrupt) else "SIGTERM"
        print(
            f"attnlab {command}: stopped: {name} arrived outside the training loop; nothing "
            "was written since the last checkpoint; run the same command to resume",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(signal.Signals[name])
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
