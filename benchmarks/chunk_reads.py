"""Random chunk reads for the input pipeline: the memory-mapped ``tokens.bin`` against an
ArrayRecord file of the same chunks (Grain's ``ArrayRecordDataSource``).

Writes ``--tokens`` random uint16 ids as ``tokens.bin`` and as ArrayRecord records of
``--window`` ids each, then times ``--reads`` reads of random chunks from each, decoded to
int32 ids as the pipeline uses them. Prints JSON with the machine's load average.

    python benchmarks/chunk_reads.py [--tokens 2000000] [--window 257] [--reads 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2_000_000)
    p.add_argument("--window", type=int, default=257)
    p.add_argument("--reads", type=int, default=20_000)
    args = p.parse_args()
    import grain
    from array_record.python import array_record_module

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, args.tokens, dtype=np.uint16)
    starts = np.arange(0, args.tokens - args.window, args.window)
    order = rng.permutation(len(starts))[: args.reads]
    report = {"config": vars(args), "chunks_per_sec": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tokens.tofile(f"{tmp}/tokens.bin")
        mapped = np.memmap(f"{tmp}/tokens.bin", dtype=np.uint16, mode="r")
        writer = array_record_module.ArrayRecordWriter(f"{tmp}/chunks.ar", "group_size:1")
        for s in starts:
            writer.write(tokens[s : s + args.window].tobytes())
        writer.close()
        source = grain.sources.ArrayRecordDataSource([f"{tmp}/chunks.ar"])
        readers = {
            "memmap": lambda i: np.asarray(mapped[starts[i] : starts[i] + args.window], np.int32),
            "array_record": lambda i: np.frombuffer(source[int(i)], np.uint16).astype(np.int32),
        }
        for name, read in readers.items():
            read(0)
            t0 = time.perf_counter()
            for i in order:
                read(i)
            rate = len(order) / (time.perf_counter() - t0)
            report["chunks_per_sec"][name] = round(rate)
    report["load"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
