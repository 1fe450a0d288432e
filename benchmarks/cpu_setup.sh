# Shared setup of the CPU side-by-side scripts (sourced by compare_cpu.sh and
# compare_offline.sh, which set KVFLOW_PY, MODEL_DIR and OUT first): the default dtype, offline
# hub settings, an empty results folder, and the HF folder of the packaged model.
if [ -z "${DTYPE:-}" ]; then
    if grep -q amx_bf16 /proc/cpuinfo; then DTYPE=bfloat16; else DTYPE=float32; fi
    echo "== dtype $DTYPE (CPU $(grep -q amx_bf16 /proc/cpuinfo && echo has || echo lacks) AMX-BF16; set DTYPE to override)"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
rm -f "$OUT"/*.json
if [ ! -f "$MODEL_DIR/config.json" ]; then
    echo "== exporting the packaged SmolLM2-135M-Instruct to $MODEL_DIR (about a minute)"
    "$KVFLOW_PY" benchmarks/export_hf.py "$MODEL_DIR"
fi
