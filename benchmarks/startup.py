"""Start-up time of ``attnlab train``: process start to the first logged step, with JAX's
persistent compilation cache cold (a fresh directory) and then warm (the same directory,
a second process), and how many programs the warm process really compiled.

Prints JSON with the machine (CPU, cores, load average) and, per run, the seconds from
``Popen`` to the line of step 1 and to the process's end.

    python benchmarks/startup.py [--config experiments/char_lm.py:tiny] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import machine  # benchmarks/machine.py

REPO = pathlib.Path(__file__).resolve().parents[1]


def one_run(config: str, workdir: pathlib.Path, cache: pathlib.Path) -> dict:
    """Seconds to the first step's line and to the end of one ``attnlab train`` process."""
    env = dict(os.environ, ATTNLAB_COMPILATION_CACHE=str(cache), PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    argv = [sys.executable, "-m", "attnlab.cli", "train", "--config", config]
    argv += ["--workdir", str(workdir), "--no-progress", "--config.eval.sample_tokens=0"]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    first = None
    for line in proc.stdout:
        if first is None and line.startswith("step=1 "):
            first = time.perf_counter() - start
    proc.wait()
    end = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"attnlab train exited with {proc.returncode}")
    return {"first_step_sec": round(first, 3), "process_sec": round(end, 3)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "experiments" / "char_lm.py") + ":tiny")
    p.add_argument("--repeats", type=int, default=3, help="cold/warm pairs, each in a new cache")
    args = p.parse_args()
    pairs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            cold = one_run(args.config, tmp / "cold", tmp / "cache")
            warm = one_run(args.config, tmp / "warm", tmp / "cache")
            pairs.append({"cold": cold, "warm": warm})
            print(json.dumps(pairs[-1]), file=sys.stderr, flush=True)
    median = lambda k, f: sorted(r[k][f] for r in pairs)[len(pairs) // 2]
    print(
        json.dumps(
            {
                "benchmark": "startup",
                "config": args.config,
                "machine": {
                    "cpu": machine.cpu_model(),
                    "cores": os.cpu_count(),
                    "load_average": [round(x, 2) for x in os.getloadavg()],
                    "python": platform.python_version(),
                },
                "runs": pairs,
                "median_first_step_sec": {k: median(k, "first_step_sec") for k in ("cold", "warm")},
            }
        )
    )


if __name__ == "__main__":
    main()
