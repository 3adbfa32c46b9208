#!/usr/bin/env bash
# The GPU measurements in one go, each benchmark's JSON and log written to OUTDIR (default
# benchmarks/results/gpu): GPT-2 small training in bfloat16 at context 1024 (cuDNN and
# chunked attention) beside nanoGPT's block under torch.compile, decoding at batch 1/8/64
# with bfloat16 caches beside transformers' generate, and the long-context attention table
# at T = 8k / 32k / 128k. Needs jax with CUDA, and torch + transformers for the peers.
#
#     bash benchmarks/gpu_suite.sh [OUTDIR [ARGS...]]   # ARGS go to every benchmark
#     bash benchmarks/gpu_suite.sh /tmp/gpu --dry-run   # on a CPU: the settings trace
#
# LIMIT=SECONDS stops any one benchmark after that long (LIMIT_<name>, e.g.
# LIMIT_train_gpu, for one of them); the rows it printed are in its log.
set -u
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
shift $(($# > 0 ? 1 : 0))
extra=("$@")
mkdir -p "$out"
export PYTHONUNBUFFERED=1

run() {  # run NAME SCRIPT ARGS...: one benchmark, its log beside its JSON
  local name=$1 limit="LIMIT_$1"
  shift
  echo "== $name: $*"
  timeout "${!limit:-${LIMIT:-0}}" python3 "$@" "${extra[@]}" --out "$out/$name.json" 2>&1 |
    tee "$out/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}"
}

run train_gpu benchmarks/train_throughput.py --device gpu --peer --shapes gpt2 --skip-compile \
  --steps 20
run decode_gpu benchmarks/decode.py --device gpu --peer --skip-compile --skip-recompute \
  --skip-contexts
run attention_long_gpu benchmarks/attention.py --device gpu --long-context \
  --impls chunked,cudnn --repeats 1
run attention_dense_gpu benchmarks/attention.py --device gpu --lengths 8192,32768 \
  --impls reference,xla --repeats 2
