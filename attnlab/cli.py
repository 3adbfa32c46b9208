"""The ``attnlab`` command: train, eval, plot, sample, sweep.

attnlab train --config experiments/NAME.py[:tiny] [--config.a.b=v ...] --workdir DIR
attnlab sweep --config experiments/NAME.py[:tiny] [--config.a.b=v ...] --workdir DIR
              [--parallel vmap|sequential] [--max-trials N] [--print-commands]
attnlab sweep --collect DIR
attnlab eval --workdir DIR
attnlab plot DIR [DIR ...] [--out loss.png]
attnlab sample --workdir DIR --prompt "..." --max-new-tokens N [--temperature T ...]
attnlab sample --pretrained HF_DIR --prompt "..." [--prompt "..."] --max-new-tokens N
attnlab data prepare FILES_OR_GLOBS... --out DIR [--tokenizer bpe|byte|char|PATH]
attnlab data fetch shakespeare | URL --sha256 HASH
attnlab sweep ... --launcher local|slurm [--partition P --timeout-min M ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def _train(args, overrides):
    from attnlab import experiment, runs, sharding

    cfg = experiment.load_config(args.config, overrides)
    sharding.initialize_distributed(cfg.distributed)  # before anything else uses JAX
    runs.train(cfg, args.workdir, progress=not args.no_progress)  # logs its records itself


def _eval(args, overrides):
    from attnlab import runs

    print(json.dumps(runs.evaluate(args.workdir)))


def _plot(args, overrides):
    from attnlab import viz

    out = args.out or str(pathlib.Path(args.dirs[0]) / "loss.png")
    viz.save_loss_curves(args.dirs, out)
    print(out)


def _sample(args, overrides):
    from attnlab import runs

    if args.pretrained:
        return _sample_pretrained(args)
    if args.workdir is None:
        raise SystemExit("attnlab sample: pass --workdir DIR (a run) or --pretrained DIR")
    cfg, trainer, task, params, step = runs.load_run(args.workdir)
    model = trainer.model(params)
    common = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if trainer.mcfg.arch == "encoder_decoder":
        if args.source is None:
            raise SystemExit('this run is an encoder-decoder model: pass --source "..."')
        tokens = runs.seq2seq_continuation(model, task, args.source, args.max_new_tokens, **common)
        print(runs.decode_known(task, tokens))
        return
    if trainer.mcfg.arch != "decoder":
        raise SystemExit("sampling needs a decoder-only or encoder-decoder run")
    prompt = args.prompt[0] if args.prompt else ""
    ids = task.encode(prompt)
    eos = getattr(task, "eos_id", None) if task.tokenizer is None else None
    tokens = runs.continuation(model, ids, args.max_new_tokens, eos_id=eos, **common)
    print(prompt + runs.decode_known(task, tokens))


def _sample_pretrained(args):
    from attnlab.pretrained import load_pretrained

    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    prompts = args.prompt or [""]
    handle = load_pretrained(args.pretrained)
    for prompt, text in zip(
        prompts, handle.generate_text(prompts, args.max_new_tokens, **options), strict=True
    ):
        print(prompt + text)


def _sweep(args, overrides):
    from attnlab import sweep

    workdir = args.workdir or args.dir
    if workdir is None:
        raise SystemExit("attnlab sweep: pass --workdir DIR (or DIR after --collect)")
    if args.collect:
        results = sweep.collect(workdir)
        for path in sweep.write_results(workdir, results):
            print(path)
        print(sweep.markdown_table(results), end="")
        return
    if args.config is None:
        raise SystemExit("attnlab sweep: --config experiments/NAME.py[:variant] is required")
    plan = sweep.load_sweep(args.config, overrides, max_trials=args.max_trials)
    if args.print_commands:
        sweep.write_manifest(plan, workdir)  # lets --collect name the trials' overrides
        for line in sweep.commands(plan, workdir):
            print(line)
        return
    if args.launcher != "inprocess":
        from attnlab.sweep.launch import launch_sweep, resources_from_args

        resources = resources_from_args(args, plan)
        results = launch_sweep(plan, workdir, launcher=args.launcher, resources=resources)
        print(sweep.markdown_table(results), end="")
        return
    results = sweep.run_sweep(
        plan,
        workdir,
        parallel=args.parallel,
        progress=not args.no_progress,
        retry_failed=args.retry_failed,
    )
    print(sweep.markdown_table(results), end="")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="attnlab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or resume) an experiment in a work directory")
    t.add_argument(
        "--config", required=True, help="experiments/NAME.py[:variant] or a saved DIR/config.json"
    )
    t.add_argument("--workdir", required=True)
    t.add_argument("--no-progress", action="store_true", help="plain log lines only")
    t.set_defaults(fn=_train, overrides=True)

    e = sub.add_parser("eval", help="evaluate the latest checkpoint on the validation split")
    e.add_argument("--workdir", required=True)
    e.set_defaults(fn=_eval)

    pl = sub.add_parser("plot", help="PNG of train/eval loss curves of one or more runs")
    pl.add_argument("dirs", nargs="+")
    pl.add_argument("--out", default=None, help="output PNG (default: FIRST_DIR/loss.png)")
    pl.set_defaults(fn=_plot)

    s = sub.add_parser("sample", help="sample from a run's latest checkpoint or a HF folder")
    s.add_argument("--workdir", default=None)
    s.add_argument("--pretrained", default=None, help="a Hugging Face folder with tokenizer.json")
    s.add_argument(
        "--prompt", default=None, action="append", help="repeat for several prompts (--pretrained)"
    )
    s.add_argument("--source", default=None, help="source text for encoder-decoder runs")
    s.add_argument("--max-new-tokens", type=int, default=200)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_sample)

    w = sub.add_parser("sweep", help="run the sweep() of an experiment; one workdir per trial")
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
    w.add_argument("--no-progress", action="store_true", help="plain log lines only")
    w.set_defaults(fn=_sweep, overrides=True)
    from attnlab.data.commands import add_parser as add_data_parser
    from attnlab.sweep.launch import add_arguments as add_launch_arguments

    add_launch_arguments(w)
    add_data_parser(sub)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if a.startswith("--config.")]
    unknown = [a for a in extra if not a.startswith("--config.")]
    if unknown or (overrides and not getattr(args, "overrides", False)):
        parser.error(f"unrecognised arguments: {' '.join(unknown or overrides)}")
    from attnlab.data.fetch import ChecksumError as DataError
    from attnlab.experiment import ExperimentError

    try:
        args.fn(args, overrides)
    except (ExperimentError, FileNotFoundError, DataError) as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
