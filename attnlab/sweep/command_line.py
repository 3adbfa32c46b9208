"""``attnlab sweep``: a grid, an Optuna search or ``--collect``, in this process or launched."""

from __future__ import annotations

from attnlab.errors import ConfigError, one_line


def _sweep(args, overrides):
    from attnlab import sweep
    from attnlab.runs.checkpoint import raise_if_stopped

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
    raise_if_stopped(f"in {workdir}; every stopped trial's checkpoint is written")
    sweep.check_failed(results)  # exit status 1 when a trial failed


def check_trials(plan):
    """Refuses a sweep before its first step when a trial's config is invalid or its batch
    does not split over its mesh (it would fail after the trials before it had trained)."""
    from attnlab import experiment
    from attnlab.devices import sharding

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


def add_parser(sub, parents) -> None:
    """Adds ``sweep`` to the ``attnlab`` subcommands (``parents``: the shared flags)."""
    w = sub.add_parser(
        "sweep", parents=parents, help="run the sweep() of an experiment; one workdir per trial"
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
    from attnlab.sweep.launch import add_arguments as add_launch_arguments

    add_launch_arguments(w)
