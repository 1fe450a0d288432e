#!/usr/bin/env bash
# Everything kvflow checks on a GPU, in one run (target: under 8 minutes on an H200):
# kernel tests (bf16, realistic shapes), engine parity CUDA vs CPU, GPU-W1/W2 for kvflow (CUDA
# graphs on, then eager) and HF transformers, measured ceilings, and the roofline fractions.
# Writes logs and results.json to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
log=$OUT/bench.log; : > "$log"
run() { echo "== $*" | tee -a "$log"; timeout "$1" "${@:2}" 2>&1 | tee -a "$log" | tail -25; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
run 150 $PY -m pytest -q -x -m gpu tests/kernels tests/gpu -p no:cacheprovider \
    --junitxml="$OUT/gpu_tests.xml"
run 60 $PY benchmarks/gpu_bench.py ceilings
run 200 $PY benchmarks/gpu_bench.py kvflow
run 150 $PY benchmarks/gpu_bench.py hf
run 150 $PY benchmarks/gpu_bench.py kvflow --enforce-eager
$PY benchmarks/roofline_report.py "$log" "$OUT/results.json" | tee "$OUT/summary.txt"
