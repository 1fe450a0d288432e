# Shared setup of the CPU side-by-side scripts (sourced by compare_cpu.sh, compare_offline.sh
# and cpu_contention.sh, which set KVFLOW_PY, MODEL_DIR, OUT and PEER_VENVS first): the peers'
# virtualenvs checked, the default dtype, offline hub settings, an empty results folder, and
# the HF folder of the packaged model.
# PEER_VENVS: the script's peers as VARIABLE:EXECUTABLE words (VLLM_VENV:python). A peer whose
# variable is unset or empty is skipped; one set to a folder without bin/EXECUTABLE (a typo,
# a venv not made yet) stops the script here, exit status 2, before any engine runs or any
# earlier result is removed: skipping it would end minutes later in a table without it.
# -h / --help: the calling script's header (its leading comment lines), then exit 0, before
# any peer check, export or run.
case "${1:-}" in
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
esac
for PEER in ${PEER_VENVS:-}; do
    PEER_VAR=${PEER%%:*} PEER_EXE=${PEER#*:}
    PEER_DIR=${!PEER_VAR:-}
    if [ -n "$PEER_DIR" ] && [ ! -x "$PEER_DIR/bin/$PEER_EXE" ]; then
        echo "$(basename "$0"): error: $PEER_VAR=$PEER_DIR has no executable $PEER_DIR/bin/$PEER_EXE;" \
             "point it at the peer's virtualenv, or unset it to skip that peer" \
             "(docs/benchmarks.md, \"Installing the peers\")" >&2
        exit 2
    fi
done
# DTYPES: the dtypes every engine runs in; each engine is then compared at its best one. Where
# the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16) both bf16 and fp32, since which is
# faster depends on the engine and the CPU (measured, not assumed); else fp32 only (oneDNN's
# bf16 matmuls, vLLM CPU's, run several times slower without those units). kvflow's own bf16
# GEMM does not (it widens bf16 weights itself: on an Ice Lake Xeon its bf16 was 1.30x its
# fp32, and --dtype auto picks bf16 there): DTYPE="bfloat16 float32" runs both on such a CPU.
# DTYPE=x runs x only.
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
