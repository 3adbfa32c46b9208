"""The ``attnlab`` command: train, eval, plot, sample, sweep.

attnlab train --config experiments/NAME.py[:tiny] [--config.a.b=v ...] --workdir DIR
              [--step N] [--allow-changes] [--verbose]
attnlab sweep --config experiments/NAME.py[:tiny] [--config.a.b=v ...] --workdir DIR
              [--parallel vmap|sequential] [--max-trials N] [--print-commands]
              [--retry-failed] [--allow-changes]
attnlab sweep --collect DIR
attnlab eval --workdir DIR [--step N] [--full]
attnlab plot DIR [DIR ...] [--out loss.png]
attnlab sample --workdir DIR [--prompt "..."] [--max-new-tokens N] [--on-overflow stop|raise]
               [--temperature T ...] [--step N]
attnlab sample --pretrained HF_DIR --prompt "..." [--prompt "..."] --max-new-tokens N
attnlab data prepare FILES_OR_GLOBS... --out DIR [--tokenizer bpe|byte|char|PATH]
attnlab data fetch shakespeare | URL --sha256 HASH
attnlab sweep ... --launcher local|slurm [--partition P --timeout-min M ...]

Expected errors (config, data, work directory, checkpoint, decoding, pretrained folders,
downloads) print one line and exit with 2 (what was asked cannot run) or 1 (the run failed:
it diverged, a checkpoint is unreadable, the disk is full). A run stopped by SIGINT or SIGTERM
writes its checkpoint, says so in one line and exits with 130 or 143. --debug or
ATTNLAB_DEBUG=1 shows the traceback, and the libraries' own warnings and log lines (Orbax,
absl, asyncio), which are hidden otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import pathlib
import signal
import sys
import threading
import warnings

from attnlab.errors import (
    AttnlabError,
    ConfigError,
    DecodeError,
    Interrupted,
    PretrainedFileError,
    WorkdirError,
    one_line,
)


def _train(args, overrides):
    from attnlab import devices, experiment, runs, sharding

    cfg = experiment.load_config(args.config, overrides)
    devices.apply(devices.choose(cfg))  # before anything else uses JAX
    sharding.initialize_distributed(cfg.distributed)
    record = runs.train(  # logs its records itself
        cfg,
        args.workdir,
        progress=not args.no_progress,
        step=args.step,
        allow_changes=args.allow_changes,
        verbose=args.verbose,
    )
    _stopped(f"at step {record.get('step')}; its checkpoint is written in {args.workdir}")


def _eval(args, overrides):
    from attnlab import runs

    print(json.dumps(runs.evaluate(args.workdir, args.step, full=args.full)))


def _plot(args, overrides):
    from attnlab import viz

    out = args.out or str(pathlib.Path(args.dirs[0]) / "loss.png")
    try:
        viz.save_loss_curves(args.dirs, out)
    except FileNotFoundError as e:
        raise WorkdirError(f"{one_line(e)}; pass directories that `attnlab train` wrote") from None
    print(out)


def _stopped(where: str):
    """Raises ``Interrupted`` when a signal stopped the training loop (after its checkpoint)."""
    from attnlab.checkpoint import stop_signal

    name = stop_signal()
    if name is not None:
        raise Interrupted(f"{name} stopped the run {where}; run the same command to resume", name)


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
    if trainer.mcfg.arch == "encoder_decoder":
        if args.source is None:
            raise DecodeError('this run is an encoder-decoder model: pass --source "..."')
        position = trainer.mcfg.position
        _room(0, len(_encode(task, args.source, "--source")), max_len, "raise", "--source")
        n = _room(args.max_new_tokens, 1, max_len, args.on_overflow, "the start token", position)
        tokens = runs.seq2seq_continuation(model, task, args.source, n, **common)
        print(runs.decode_known(task, tokens))
        return
    if trainer.mcfg.arch != "decoder":
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


def _sweep(args, overrides):
    from attnlab import sweep

    workdir = args.workdir or args.dir
    if workdir is None:
        raise ConfigError("attnlab sweep: pass --workdir DIR (or DIR after --collect)")
    if args.collect:
        results = sweep.collect(workdir)
        for path in sweep.write_results(workdir, results):
            print(path)
        print(sweep.markdown_table(results), end="")
        return
    if args.config is None:
        raise ConfigError("attnlab sweep: --config experiments/NAME.py[:variant] is required")
    plan = sweep.load_sweep(args.config, overrides, max_trials=args.max_trials)
    if isinstance(plan, sweep.SearchPlan):
        return _search(args, plan, workdir)
    if args.print_commands:
        sweep.write_manifest(plan, workdir)  # lets --collect name the trials' overrides
        for line in sweep.commands(plan, workdir):
            print(line)
        return
    if args.launcher != "inprocess":
        from attnlab.sweep.launch import launch_sweep, resources_from_args

        resources = resources_from_args(args, plan)
        results = launch_sweep(
            plan,
            workdir,
            launcher=args.launcher,
            resources=resources,
            retry_failed=args.retry_failed,
            allow_changes=args.allow_changes,
        )
        print(sweep.markdown_table(results), end="")
        sweep.check_failed(results)
        return
    from attnlab import devices

    # One device per core where every trial's batches divide (trials train in this process).
    devices.apply(min(devices.choose(t.cfg) for t in plan.trials))
    check_trials(plan)
    results = sweep.run_sweep(
        plan,
        workdir,
        parallel=args.parallel,
        progress=not args.no_progress,
        retry_failed=args.retry_failed,
        allow_changes=args.allow_changes,
    )
    print(sweep.markdown_table(results), end="")
    _stopped(f"in {workdir}; every stopped trial's checkpoint is written")
    sweep.check_failed(results)  # exit status 1 when a trial failed


def check_trials(plan):
    """Refuses a sweep before its first step when a trial's config is invalid or its batch
    does not split over its mesh (it would fail after the trials before it had trained)."""
    from attnlab import experiment, sharding

    for t in plan.trials:
        try:
            experiment.validate(t.cfg)
            mesh = sharding.mesh_from_config(t.cfg)
        except ConfigError as e:
            raise ConfigError(f"trial {t.name}: {one_line(e)}") from None
        n = sharding.axis_size(mesh, sharding.resolve_rules(t.cfg.mesh.get("rules")).get("batch"))
        if int(t.cfg.train.batch_size) % n:
            raise sharding.MeshError(
                f"trial {t.name}: train.batch_size={t.cfg.train.batch_size} is not divisible "
                f"by the mesh's batch axes ({n} devices: mesh.data x mesh.fsdp); use a "
                f"multiple of {n}"
            )


def _search(args, plan, workdir):
    """An Optuna search: in this process, or as ``--workers`` jobs sharing ``--storage``."""
    from attnlab import devices, sweep

    if args.print_commands:
        raise ConfigError(
            "attnlab sweep: an Optuna search suggests its trials as it goes, so it has no "
            "commands to print; start several `attnlab sweep` processes on one --storage URL"
        )
    if args.launcher != "inprocess":
        from attnlab.sweep.launch import launch_search, resources_from_args

        results = launch_search(
            plan,
            workdir,
            launcher=args.launcher,
            resources=resources_from_args(args, plan),
            workers=args.workers,
            storage=args.storage,
            study_name=args.study_name,
        )
    else:
        devices.apply(devices.choose(plan.base))
        results = sweep.run_search(
            plan,
            workdir,
            storage=args.storage,
            study_name=args.study_name,
            parallel=args.parallel,
            progress=not args.no_progress,
        )
    print(sweep.markdown_table(results), end="")
    sweep.check_failed(results)


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
    step = argparse.ArgumentParser(add_help=False)
    step.add_argument("--step", type=int, default=None, help="the checkpoint step to use")

    t = sub.add_parser(
        "train", parents=[debug, step], help="train (or resume) an experiment in a work directory"
    )
    t.add_argument(
        "--config", required=True, help="experiments/NAME.py[:variant] or a saved DIR/config.json"
    )
    t.add_argument("--workdir", required=True)
    t.add_argument("--no-progress", action="store_true", help="plain log lines only")
    t.add_argument("--verbose", action="store_true", help="also print how the state is sharded")
    t.add_argument(
        "--allow-changes",
        action="store_true",
        help="resume with changed optim/train values (applied from the resumed step on)",
    )
    t.set_defaults(fn=_train, overrides=True)

    e = sub.add_parser(
        "eval", parents=[debug, step], help="evaluate the latest checkpoint on the validation split"
    )
    e.add_argument("--workdir", required=True)
    e.add_argument(
        "--full",
        action="store_true",
        help="every token of the validation split once (non-overlapping context windows)",
    )
    e.set_defaults(fn=_eval)

    pl = sub.add_parser(
        "plot", parents=[debug], help="PNG of train/eval loss curves of one or more runs"
    )
    pl.add_argument("dirs", nargs="+")
    pl.add_argument("--out", default=None, help="output PNG (default: FIRST_DIR/loss.png)")
    pl.set_defaults(fn=_plot)

    s = sub.add_parser(
        "sample", parents=[debug, step], help="sample from a run's checkpoint or a HF folder"
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

    w = sub.add_parser(
        "sweep", parents=[debug], help="run the sweep() of an experiment; one workdir per trial"
    )
    w.add_argument("dir", nargs="?", default=None, help="the sweep directory (with --collect)")
    w.add_argument("--config", default=None, help="experiments/NAME.py[:variant]")
    w.add_argument("--workdir", default=None, help="the sweep directory; trials go in DIR/<trial>")
    w.add_argument(
        "--parallel",
        choices=("vmap", "sequential"),
        default="vmap",
        help="vmap: stack trials that differ only in seeds/optimiser values (default)",
    )
    w.add_argument("--max-trials", type=int, default=None, help="only the first N trials")
    w.add_argument(
        "--print-commands", action="store_true", help="print one `attnlab train` line per trial"
    )
    w.add_argument("--collect", action="store_true", help="rebuild DIR/results.* from DIR/*/")
    w.add_argument("--retry-failed", action="store_true", help="train failed trials again")
    w.add_argument(
        "--storage",
        default=None,
        help="Optuna search: the study's database URL (default: sqlite:///DIR/study.db)",
    )
    w.add_argument("--study-name", default=None, help="Optuna search: default DIR's name")
    w.add_argument(
        "--workers", type=int, default=1, help="Optuna search with --launcher: jobs sharing it"
    )
    w.add_argument(
        "--allow-changes",
        action="store_true",
        help="continue trained trials whose values (or total-dependent schedule) changed",
    )
    w.add_argument("--no-progress", action="store_true", help="plain log lines only")
    w.set_defaults(fn=_sweep, overrides=True)
    from attnlab.data.commands import add_parser as add_data_parser
    from attnlab.sweep.launch import add_arguments as add_launch_arguments

    add_launch_arguments(w)
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
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if a.startswith("--config.")]
    unknown = [a for a in extra if not a.startswith("--config.")]
    if unknown or (overrides and not getattr(args, "overrides", False)):
        parser.error(f"unrecognised arguments: {' '.join(unknown or overrides)}")
    command = " ".join(filter(None, [args.command, getattr(args, "data_command", None)]))
    debug = debugging(args)
    from attnlab import checkpoint

    checkpoint._RECEIVED.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        with contextlib.nullcontext() if debug else quiet_libraries():
            compilation_cache()
            args.fn(args, overrides)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
