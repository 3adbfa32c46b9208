"""The performance table of docs/benchmarks.md, generated from the benchmarks' JSON.

Each benchmark writes its JSON with ``--out FILE``; this script reads those files and prints
a Markdown table (every figure beside its roofline fraction and the PyTorch peer where the
run measured one), headed by the machines they ran on (CPU, cores, load, date, the limits
measured in the same run). ``--write FILE`` replaces the text between the two markers

    <!-- report.py: begin -->
    <!-- report.py: end -->

in FILE (docs/benchmarks.md), so the table there is regenerated, never edited by hand.

    python benchmarks/report.py benchmarks/results/*.json [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import re
import sys

BEGIN, END = "<!-- report.py: begin -->", "<!-- report.py: end -->"


def _n(x, digits=1):
    return "-" if x is None else f"{x:,.{digits}f}"


def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def dry_run(d) -> bool:
    return bool(d.get("settings", {}).get("dry_run")) or "dry run" in str(d.get("device"))


def _run_label(d):
    device = d.get("device") or ("gpu" if d["machine"].get("backend") == "gpu" else "cpu")
    return "GPU settings dry run on a CPU: checked, not measured; no rows" if dry_run(d) else device


def train_rows(d):
    for r in d["results"]:
        what = f"train {r['n_layers']} x {r['d_model']}, context {r['seq_len']}, batch {r['batch']}"
        peer = r.get("peer_torch") or {}
        yield dict(
            work=f"{what} ({r['setting']}), tokens/s",
            attnlab=_n(r.get("tokens_per_sec")),
            roofline=f"MFU {_pct(r.get('mfu'))} (square {_pct(r.get('mfu_square'))})"
            if "mfu" in r
            else "-",
            peer=f"{_n(peer.get('tokens_per_sec'))} (MFU {_pct(peer.get('mfu'))})"
            if "tokens_per_sec" in peer
            else "-",
            ratio=_n(r.get("vs_peer"), 2),
        )


def decode_rows(d):
    for r in d["throughput"]:
        if r["mode"] != "cached":
            continue
        peer = r.get("peer_transformers") or {}
        bound = r.get("roofline_tokens_per_s")
        yield dict(
            work=f"greedy decode {r['model']}, batch {r['batch']}, {r.get('dtype', 'float32')}, "
            f"{r['new_tokens']} new tokens, tokens/s",
            attnlab=_n(r["tokens_per_s"]),
            roofline=f"{_pct(r.get('of_roofline'))} of {_n(bound)} ({r.get('bound_by')})"
            if bound
            else "-",
            peer=f"{_n(peer.get('tokens_per_s'))} ({_pct(peer.get('of_roofline'))})"
            if "tokens_per_s" in peer
            else "-",
            ratio=_n(r.get("vs_peer"), 2),
        )
    yield from per_token_rows(d)


def per_token_rows(d):
    for r in d.get("per_token", []):
        yield dict(
            work=f"decode loop per token, {r['model']}, batch 1, context {r['context']:,}",
            attnlab=f"{_n(r['cached_ms'], 3)} ms",
            roofline=f"{_pct(r.get('of_roofline'))} of {_n(r.get('roofline_tokens_per_s'))} "
            f"tokens/s ({r.get('bound_by')})",
            peer="-",
            ratio="-",
        )


def attention_rows(d):
    for r in d["results"]:
        if "impl" not in r:
            continue
        if "ms" in r:
            value, roof = f"{_n(r['ms'], 2)} ms", f"{_pct(r.get('of_peak'))} of matmul peak"
        else:
            value, roof = r.get("skipped", "compiled only"), "-"
        yield dict(
            work=f"causal attention fwd + bwd, `{r['impl']}`, T = {r['T']:,}",
            attnlab=value,
            roofline=roof + f"; temporaries {_n(r.get('temp_mib'))} MiB",
            peer="-",
            ratio="-",
        )


def moe_rows(d):
    c = d["config"]
    for name, r in d["results"].items():
        yield dict(
            work=f"FFN step `{name}`, {c['tokens_per_step']} tokens, d_model {c['d_model']}",
            attnlab=f"{_n(r['ms_per_step'], 2)} ms",
            roofline=f"{_pct(r.get('of_peak'))} of the matmul rate at its shape",
            peer="-",
            ratio=_n(r["vs_dense"], 2) + "x dense",
        )


def pipeline_rows(d):
    for name, r in d["pipelines"].items():
        yield dict(
            work=f"input pipeline `{name}`, batches/s",
            attnlab=_n(r["batches_per_sec"]),
            roofline=f"waits {_pct(r['wait_fraction'])} of the train loop",
            peer="-",
            ratio="-",
        )


HOST_EVENTS = ("Pjit", "PJRT", "Common", "[", "jit_", "command_buffer", "cuGraph", "Thunk")


def profile_rows(d):
    gpu = d["machine"].get("backend") == "gpu"
    for name, r in d["programs"].items():
        if gpu:  # a GPU trace names kernels as CUDA does: the longest device kernels
            kernels = [e for e in r.get("top_events", []) if not e["event"].startswith(HOST_EVENTS)]
            top = ", ".join(f"`{e['event'][:40]}` {_n(e['ms'], 2)}" for e in kernels[:6])
            yield dict(work=f"profile: {name}, the longest kernels (ms per step)",
                       attnlab=f"{_n(r['wall_ms'])} ms wall", roofline=top or "-", peer="-",
                       ratio="-")  # fmt: skip
            continue
        share = r["share"]
        rest = ", ".join(f"{k} {_pct(v)}" for k, v in share.items() if k != "matmul")
        yield dict(
            work=f"profile: {name}, kernel time by kind",
            attnlab=f"{_n(r['wall_ms'])} ms wall, {_n(r['kernel_ms'])} ms in kernels",
            roofline=f"matmul {_pct(share.get('matmul', 0))}; {rest or 'nothing else'}",
            peer="-",
            ratio="-",
        )


ROWS = {  # the benchmark's name in its JSON -> its rows
    "train_throughput": train_rows,
    "decode": decode_rows,
    "attention": attention_rows,
    "moe_ffn_step": moe_rows,
    "input_pipeline": pipeline_rows,
    "profile": profile_rows,
}


def kind(d):
    return d.get("benchmark") or ("decode" if "throughput" in d else None)


def machine_line(i, d):
    m, lim = d["machine"], d.get("limits") or {}
    load = m.get("load_average", ["?"])[0]
    parts = [f"{m.get('cpu', '?')}, {m.get('cores_in_use', '?')} cores", m.get("date", "?"),
             f"load {load}", f"jax {m.get('jax', '?')}", m.get("device_kind", "?")]  # fmt: skip
    if lim.get("square_matmul_gflops"):
        parts.append(f"{lim['dtype']} matmul {lim['square_matmul_gflops']} GFLOP/s")
    if lim.get("copy_gbps"):
        parts.append("copy " + " / ".join(f"{v} GB/s ({k})" for k, v in lim["copy_gbps"].items()))
    if lim.get("read_gbps"):
        parts.append("read " + " / ".join(f"{v} GB/s ({k})" for k, v in lim["read_gbps"].items()))
    return f"{i}. `{d['_file']}` ({_run_label(d)}): " + ", ".join(parts)


def table(files) -> str:
    runs = []
    for path in files:
        with open(path) as f:
            d = json.load(f)
        if kind(d) in ROWS:
            runs.append(d | {"_file": path})
    lines = ["Runs (the machine and the limits each measured):", ""]
    lines += [machine_line(i, d) for i, d in enumerate(runs, 1)]
    lines += ["", "| run | work | attnlab | of its roofline | PyTorch peer | ratio |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for i, d in enumerate(runs, 1):
        for r in [] if dry_run(d) else ROWS[kind(d)](d):
            cells = [r["work"], r["attnlab"], r["roofline"], r["peer"], r["ratio"]]
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(path, text):
    with open(path) as f:
        doc = f.read()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        sys.exit(f"{path}: no {BEGIN} ... {END} markers; add them where the table goes")
    with open(path, "w") as f:
        f.write(pattern.sub(lambda _: f"{BEGIN}\n{text}{END}", doc))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="JSON files written by the benchmarks' --out")
    p.add_argument("--write", default=None, help="replace the marked table in this file")
    args = p.parse_args(argv)
    text = table(args.files)
    print(text)
    if args.write:
        write(args.write, text)


if __name__ == "__main__":
    main()
