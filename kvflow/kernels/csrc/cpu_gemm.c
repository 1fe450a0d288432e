/*
 * fp32 GEMM against a weight packed once: y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]).
 *
 * The layout and loop nest follow Goto & van de Geijn, "Anatomy of High-Performance Matrix
 * Multiplication" (ACM TOMS 2008), as BLIS arranges it (Van Zee & van de Geijn 2015):
 *
 *   - the weight is packed once, after loading, into panels of NR = 16 output columns stored
 *     k-major ([ceil(n/16)][k][16], zero-padded), so the micro-kernel reads it with unit stride;
 *   - per call, x is packed in blocks of up to MC = 96 rows (about 256 KB, kept in L2) into
 *     MR = 6 row micro-panels stored k-major ([rows/6][k][6]);
 *   - the micro-kernel multiplies a 6 x KC micro-panel of x by a KC x 16 micro-panel of the
 *     weight (kept in L1 across the MC / MR micro-panels of the block) into 6 x 16 accumulators:
 *     12 eight-lane registers, two weight loads and six broadcasts per k, 12 FMAs.
 *
 * Threads split the weight's panels (output columns), so every output element is computed by
 * one thread in one fixed k order: results do not depend on the thread count. Each thread packs
 * the x blocks it needs itself (no barrier). Threads come from torch's OpenMP runtime (see
 * cpu_attention.c).
 *
 * Why not oneDNN: at the decode batch sizes a serving engine runs most of the time (tens of
 * rows), oneDNN's fp32 inner product reached 40-90 GFLOP/s on a 2-core AVX2 EPYC against
 * 110-130 for this kernel, with equal speed at 2,048 rows (docs/benchmarks.md).
 */
#include "cpu_common.h"

#include <omp.h>

enum { MR = 6, NR = 16, KC = 256, MC = 96 };

static inline v8f splat8(float s) { return (v8f){s, s, s, s, s, s, s, s}; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Floats in the packed form of an [n, k] weight. */
int64_t kvflow_gemm_packed_size(int64_t n, int64_t k) { return (n + NR - 1) / NR * NR * k; }

/* w [n, k] fp32 (row stride w_stride elements) -> packed [ceil(n/16)][k][16], zero-padded. */
void kvflow_gemm_pack(const float *w, int64_t w_stride, int64_t n, int64_t k, float *packed,
                      int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = packed + p * k * NR;
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t col = p * NR + j;
            for (int64_t kk = 0; kk < k; ++kk)
                dst[kk * NR + j] = col < n ? w[col * w_stride + kk] : 0.f;
        }
    }
}

/* rows x k of x (row stride x_stride) -> micro-panels [ceil(rows/6)][k][6], zero-padded. */
static void pack_x(const float *x, int64_t x_stride, int64_t rows, int64_t k, float *xp) {
    for (int64_t i0 = 0; i0 < rows; i0 += MR) {
        float *dst = xp + i0 * k;
        const int64_t r = min64(rows - i0, MR);
        for (int64_t kk = 0; kk < k; ++kk) {
            for (int64_t i = 0; i < r; ++i) dst[kk * MR + i] = x[(i0 + i) * x_stride + kk];
            for (int64_t i = r; i < MR; ++i) dst[kk * MR + i] = 0.f;
        }
    }
}

/* c[6][16] (row stride ldc) = init + xp[kc][6 (stride xs)] @ wp[kc][16], where init is c itself
 * (accumulate), bias (16 values) or zero (bias NULL). Meanwhile prefetches pf_lines cache lines
 * (16 floats each) from pf: the weight chunk the next micro-kernels will read. */
static inline void micro_kernel(int64_t kc, const float *xp, const float *wp, float *c,
                                int64_t ldc, int accumulate, const float *bias,
                                const float *pf, int64_t pf_lines) {
    v8f c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    v8f c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    for (int64_t kk = 0; kk < kc; ++kk, xp += MR, wp += NR) {
        if (kk < pf_lines) __builtin_prefetch(pf + kk * NR);
        const v8f w0 = load8(wp), w1 = load8(wp + 8);
        v8f a = splat8(xp[0]);
        c00 += a * w0, c01 += a * w1;
        a = splat8(xp[1]), c10 += a * w0, c11 += a * w1;
        a = splat8(xp[2]), c20 += a * w0, c21 += a * w1;
        a = splat8(xp[3]), c30 += a * w0, c31 += a * w1;
        a = splat8(xp[4]), c40 += a * w0, c41 += a * w1;
        a = splat8(xp[5]), c50 += a * w0, c51 += a * w1;
    }
    const v8f acc[2 * MR] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    const v8f init0 = bias ? load8(bias) : (v8f){0}, init1 = bias ? load8(bias + 8) : (v8f){0};
    for (int i = 0; i < MR; ++i) {
        float *row = c + i * ldc;
        const v8f lo = accumulate ? load8(row) : init0, hi = accumulate ? load8(row + 8) : init1;
        store8(row, lo + acc[2 * i]);
        store8(row + 8, hi + acc[2 * i + 1]);
    }
}

/* Rows [0, mb) of packed x (pack_x over all k) times weight panel p into y, KC values of k at a
 * time. The weight is read once, front to back (panels are contiguous), while each micro-kernel
 * prefetches its share of the next KC x 16 chunk. Edge tiles (fewer than 6 rows or 16 columns)
 * go through a 6 x 16 scratch tile. */
static void rows_times_panel(const float *xp, int64_t mb, int64_t k, const float *panel,
                             int64_t cols, const float *bias, float *y, int64_t y_stride) {
    float tile[MR * NR];
    const int64_t kernels = (mb + MR - 1) / MR;
    for (int64_t pc = 0; pc < k; pc += KC) {
        const int64_t kc = min64(k - pc, KC);
        const float *wp = panel + pc * NR, *next = wp + kc * NR;
        const int64_t pf_lines = (KC + kernels - 1) / kernels;
        const float *init = pc == 0 ? bias : NULL;
        for (int64_t ir = 0; ir < mb; ir += MR) {
            const int64_t rows = min64(mb - ir, MR);
            const float *x_micro = xp + ir * k + pc * MR, *pf = next + ir / MR * pf_lines * NR;
            float *c = y + ir * y_stride;
            if (rows == MR && cols == NR) {
                micro_kernel(kc, x_micro, wp, c, y_stride, pc > 0, init, pf, pf_lines);
                continue;
            }
            micro_kernel(kc, x_micro, wp, tile, NR, 0, init, pf, pf_lines);
            for (int64_t i = 0; i < rows; ++i)
                for (int64_t j = 0; j < cols; ++j)
                    c[i * y_stride + j] = (pc > 0 ? c[i * y_stride + j] : 0.f) + tile[i * NR + j];
        }
    }
}

/* Rows of x per packed block: all of k for up to 96 rows, within ~256 KB (half this EPYC's L2). */
static int64_t block_rows(int64_t k) {
    const int64_t rows = (65536 / (k > 0 ? k : 1)) / MR * MR;
    return rows < MR ? MR : rows > MC ? MC : rows;
}

/* x [m, k] fp32 (row stride x_stride) @ packed weight (kvflow_gemm_pack of [n, k]) + bias [n]
 * (or NULL) -> y [m, n] (row stride y_stride). Returns 1 when scratch cannot be allocated. */
int kvflow_gemm(const float *x, int64_t x_stride, const float *packed, const float *bias,
                float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR, mb_max = block_rows(k);
    int failed = 0;
    if (m <= 0 || n <= 0) return 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        float *xp = p0 < p1 ? malloc(sizeof(float) * (mb_max + MR) * (k > 0 ? k : 1)) : NULL;
        failed |= p0 < p1 && !xp;
        for (int64_t ic = 0; xp && ic < m; ic += mb_max) {
            const int64_t mb = min64(m - ic, mb_max);
            pack_x(x + ic * x_stride, x_stride, mb, k, xp);
            float bias_tile[NR];
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t cols = min64(n - p * NR, NR);
                float *y_panel = y + ic * y_stride + p * NR;
                if (bias)
                    for (int64_t j = 0; j < NR; ++j) bias_tile[j] = j < cols ? bias[p * NR + j] : 0.f;
                if (k == 0) { /* an empty product is the bias (or zero) */
                    for (int64_t i = 0; i < mb; ++i)
                        for (int64_t j = 0; j < cols; ++j)
                            y_panel[i * y_stride + j] = bias ? bias_tile[j] : 0.f;
                    continue;
                }
                rows_times_panel(xp, mb, k, packed + p * k * NR, cols, bias ? bias_tile : NULL,
                                 y_panel, y_stride);
            }
        }
        free(xp);
    }
    return failed;
}
