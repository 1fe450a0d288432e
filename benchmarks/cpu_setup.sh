# Shared setup of the CPU side-by-side scripts (sourced by compare_cpu.sh and
# compare_offline.sh, which set KVFLOW_PY, MODEL_DIR and OUT first): the default dtype, offline
# hub settings, an empty results folder, and the HF folder of the packaged model.
# DTYPES: the dtypes every engine runs in; each engine is then compared at its best one. Where
# the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16) both bf16 and fp32, since which is
# faster depends on the engine and the CPU (measured, not assumed); else fp32 only (bf16
# matmuls without those units run several times slower). DTYPE=x runs x only.
if [ -n "${DTYPE:-}" ]; then
    DTYPES=$DTYPE
elif grep -qw -e avx512_bf16 -e amx_bf16 /proc/cpuinfo; then
    DTYPES="bfloat16 float32"
else
    DTYPES=float32
fi
if [ -n "${DTYPE:-}" ]; then DTYPES_WHY="DTYPE set"; else DTYPES_WHY="set DTYPE to run one"; fi
echo "== dtypes: $DTYPES ($DTYPES_WHY); CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs, bf16 units: $(grep -ow -e avx512_bf16 -e amx_bf16 /proc/cpuinfo | sort -u | xargs echo none | sed 's/^none \(.\)/\1/'); $(uptime | sed 's/.*load/load/')"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
rm -f "$OUT"/*.json
if [ ! -f "$MODEL_DIR/config.json" ]; then
    echo "== exporting the packaged SmolLM2-135M-Instruct to $MODEL_DIR (about a minute)"
    "$KVFLOW_PY" benchmarks/export_hf.py "$MODEL_DIR"
fi
