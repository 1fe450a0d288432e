#!/usr/bin/env bash
# Everything kvflow checks on a GPU, in one run (target: under 8 minutes on an H200):
# kernel tests (bf16, realistic shapes) and engine parity CUDA vs CPU, measured ceilings,
# GPU-W1/W2 for kvflow (CUDA graphs) and HF transformers, W2 for kvflow eager, and kvflow's
# fraction of the roofline. Writes bench.log, results.json and summary.txt to $OUT (./out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
log=$OUT/bench.log; : > "$log"
run() { echo "== $(date +%T) $*" | tee -a "$log"; timeout "$1" "${@:2}" 2>&1 | tee -a "$log" | tail -30; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
run 120 $PY -m pytest -q -m gpu tests/kernels tests/gpu -p no:cacheprovider -o addopts=""
run 45 $PY benchmarks/gpu_bench.py ceilings
run 180 $PY benchmarks/gpu_bench.py kvflow
run 120 $PY benchmarks/gpu_bench.py hf
run 80 $PY benchmarks/gpu_bench.py kvflow --enforce-eager --w2-only
echo "== $(date +%T) report" | tee -a "$log"
$PY benchmarks/roofline_report.py "$log" "$OUT/results.json" > "$OUT/summary.txt"
tail -12 "$OUT/summary.txt"
