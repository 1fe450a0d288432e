#!/usr/bin/env bash
# Fuzz `kvflow serve` (tiny random Llama) with schemathesis: N examples per operation and mode
# (default 500), valid and invalid bodies, streamed or not. Passes when no response is a 5xx,
# none takes longer than 60 s, and afterwards the server is healthy with every KV block free.
# Usage: bash benchmarks/fuzz_server.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
examples="${1:-500}"
echo "fuzzing with ${examples} examples per operation; $(uptime)"
KVFLOW_FUZZ_EXAMPLES="$examples" .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/e2e/test_schemathesis.py
