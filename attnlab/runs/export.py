"""A run as a Hugging Face folder: ``export_run`` and the ``attnlab export-hf`` command
(``attnlab.pretrained.export`` writes the model)."""

from __future__ import annotations


def add_parser(sub, parents) -> None:
    """Adds ``export-hf`` to the ``attnlab`` subcommands (``parents``: the shared
    flags, ``--step`` among them)."""
    e = sub.add_parser(
        "export-hf",
        parents=parents,
        help="write a run's checkpoint as a Hugging Face folder (config.json + safetensors)",
    )
    e.add_argument("--workdir", required=True, help="the run's work directory")
    e.add_argument("--out", required=True, help="a new (or empty) folder to write")
    e.set_defaults(fn=_export)


def _export(args, overrides):
    del overrides  # export-hf takes no --config overrides
    family = export_run(args.workdir, args.out, args.step)
    print(f"wrote {args.out} (model_type {family}): config.json, model.safetensors")


def export_run(workdir, out, step: int | None = None) -> str:
    """Exports checkpoint ``step`` (default: the newest) of the run in ``workdir``."""
    from attnlab.pretrained.export import export_model
    from attnlab.runs.loading import load_run

    return export_model(load_run(workdir, step).model, out)
