/*
 * INT8 embedding lookup: rows of a per-row-scaled int8 vocabulary table, dequantized into the
 * activation dtype (kvflow/quant/int8.py's Int8EmbeddingMethod, used by `--quantization int8`
 * and `int4`):
 *
 *     out[t, :] = to_dtype((float)q[ids[t], :] * scale[ids[t]])
 *
 * The int8 -> fp32 widening is exact, the product is one fp32 multiply (rounded once, IEEE
 * round-to-nearest-even) and the conversion to bf16/fp16 rounds to nearest even, as torch's
 * `F.embedding(ids, q).float() * scale[ids, None]` then `.to(dtype)` does: the result is that
 * expression bit for bit. No addition is involved, so floating-point contraction cannot change
 * a value either.
 *
 * One C entry point instead of torch operators lets a CPU step graph record the lookup
 * (kvflow/worker/cpu_step_record.py refuses a step that computes with a torch operator) and
 * cpu_replay.c replay it. Like the other kernels the source is compiled once per ISA level
 * (kvflow/kernels/cpu_build.py); each row's loop is vectorized at that level's width. Rows are
 * shared among OpenMP threads (torch's runtime) only for a lookup of 64K+ values (prefill);
 * a decode step's rows stay on the calling thread (cpu_common.h's threads_for).
 */
#include "cpu_common.h"
#include "cpu_entry_points.h"

/* One row: k int8 values at src times s, written as dtype `odt` at dst. */
static void dequantize_row(const int8_t *src, float s, void *dst, int64_t k, int odt) {
    if (odt == DT_F32) {
        float *d = dst;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) d[i] = (float)src[i] * s;
    } else if (odt == DT_BF16) {
        uint16_t *d = dst;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) d[i] = f32_to_bf16((float)src[i] * s);
    } else {
        _Float16 *d = dst;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) d[i] = (_Float16)((float)src[i] * s);
    }
}

/* table: int8 [n, k] (row stride table_stride elements), scale: fp32 [n], ids: int64 [m],
 * out: [m, k] contiguous of dtype odt (DT_F32, DT_BF16, DT_F16). Returns 0, or 2 when an id
 * lies outside [0, n) or odt is not a dtype code (nothing is written then). */
int kvflow_int8_embedding_rows(const int8_t *table, int64_t table_stride, const float *scale,
                               int64_t n, int64_t k, const int64_t *ids, int64_t m, void *out,
                               int odt, int num_threads) {
    if (odt != DT_F32 && odt != DT_BF16 && odt != DT_F16) return 2;
    for (int64_t t = 0; t < m; ++t)
        if (ids[t] < 0 || ids[t] >= n) return 2;
    const size_t row_bytes = (size_t)k * elem_size(odt);
    const int threads = threads_for(m * k, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < m; ++t)
        dequantize_row(table + ids[t] * table_stride, scale[ids[t]], (char *)out + t * row_bytes,
                       k, odt);
    return 0;
}
