"""``attnlab data prepare`` and ``attnlab data fetch``."""

from __future__ import annotations

import json


def _prepare(args, overrides):
    from attnlab.data.prepared import prepare

    meta = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        progress=not args.no_progress,
    )
    print(json.dumps({k: v for k, v in meta.items() if k != "sources"}))


def _fetch(args, overrides):
    from attnlab.data.fetch import fetch

    print(fetch(args.source, sha256=args.sha256, filename=args.name, progress=not args.no_progress))


def add_parser(sub) -> None:
    """Adds ``data prepare`` and ``data fetch`` to the ``attnlab`` subcommands."""
    d = sub.add_parser("data", help="prepare token files, fetch datasets")
    dsub = d.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="tokenize text files into a memory-mapped token file")
    p.add_argument("inputs", nargs="+", help="text files or glob patterns")
    p.add_argument("--out", required=True, help="the prepared corpus directory")
    p.add_argument(
        "--tokenizer", default="bpe", help="bpe (trained on the inputs), byte, char or a path"
    )
    p.add_argument("--vocab-size", type=int, default=1024, help="of a trained bpe")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=_prepare)
    f = dsub.add_parser("fetch", help="download a dataset once into the cache, checksum verified")
    f.add_argument("source", help="a known name (shakespeare) or a URL")
    f.add_argument("--sha256", default=None, help="expected SHA-256 (required for a URL)")
    f.add_argument("--name", default=None, help="file name in the cache")
    f.add_argument("--no-progress", action="store_true")
    f.set_defaults(fn=_fetch)
