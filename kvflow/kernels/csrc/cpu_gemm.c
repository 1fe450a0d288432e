/*
 * fp32 GEMM against a weight packed once: y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]).
 *
 * The layout and loop nest follow Goto & van de Geijn, "Anatomy of High-Performance Matrix
 * Multiplication" (ACM TOMS 2008), as BLIS arranges it (Van Zee & van de Geijn 2015):
 *
 *   - the weight is packed once, after loading, into panels of NR = 16 output columns stored
 *     k-major ([ceil(n/16)][k][16], zero-padded), so the micro-kernel reads it with unit stride;
 *   - x is read in place, in blocks of up to MC = 96 rows (at most 256 KB, so a block stays in
 *     L2 while every panel of the weight passes over it). Goto packs x as well, to make its
 *     reads unit-stride; here the micro-kernel reads six row streams instead, which measured
 *     equal or faster and leaves no per-call packing or scratch memory;
 *   - the micro-kernel multiplies 6 rows x KC of x by a KC x 16 micro-panel of the weight (kept
 *     in L1 across the micro-kernels of a block) into 6 x 16 accumulators: 12 eight-lane
 *     registers, two weight loads and six broadcasts per k, 12 FMAs.
 *
 * Work is split into (x block, weight panel) items. Thread t owns a contiguous share of the
 * panels and walks it front to back for every x block (so each thread streams its share of the
 * weight in order); a thread that finishes early takes the remaining items from the back of
 * another thread's share. On a shared machine one core often runs slower than the other for a
 * while, and a fixed split would leave the fast one waiting. Every output element is still
 * computed by one thread in one fixed k order, so results do not depend on the thread count or
 * on which thread ran an item. Threads come from torch's OpenMP runtime (see cpu_attention.c).
 *
 * 16-bit weights (kvflow_gemm_pack16 / kvflow_gemm_w16): the same panels hold bf16 or fp16
 * values, widened to fp32 in registers as the micro-kernel loads them (exact), with fp32
 * activations and fp32 outputs. The LM head of a 16-bit model runs this way, so its logits are
 * never rounded to 16 bits.
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

/* w16 [n, k] bf16/fp16 (row stride w_stride elements) -> packed [ceil(n/16)][k][16] of the
 * same dtype, zero-padded (kvflow_gemm_pack's layout, two bytes per value). */
void kvflow_gemm_pack16(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                        uint16_t *packed, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        uint16_t *dst = packed + p * k * NR;
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t col = p * NR + j;
            for (int64_t kk = 0; kk < k; ++kk)
                dst[kk * NR + j] = col < n ? w[col * w_stride + kk] : 0;
        }
    }
}

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef _Float16 v8h __attribute__((vector_size(16)));

/* Eight weight values at element `i` of a panel of dtype wdt, widened to fp32 (exact). */
static inline __attribute__((always_inline)) v8f load_w8(const void *wp, int64_t i, int wdt) {
    if (wdt == DT_F32) return load8((const float *)wp + i);
    v8u16 h;
    memcpy(&h, (const uint16_t *)wp + i, sizeof h);
    if (wdt == DT_F16) {
        v8h f;
        memcpy(&f, &h, sizeof f);
        return __builtin_convertvector(f, v8f);
    }
    const v8u32 u = __builtin_convertvector(h, v8u32) << 16; /* bf16 = the top half of fp32 */
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* c[6][16] (row stride ldc) = init + x[6 rows (stride xs)][kc] @ wp[kc][16], where init is c
 * itself (accumulate), bias (16 values) or zero (bias NULL). With rows < 6 the missing rows
 * re-read row 0 (their results are the caller's to drop). Meanwhile prefetches pf_lines cache
 * lines (64 bytes each) from pf: the weight chunk the next micro-kernels will read. wdt: the
 * panel's dtype (a constant wherever this is inlined, so each dtype gets its own loop). */
static inline __attribute__((always_inline)) void micro_kernel(
        int64_t kc, const float *x, int64_t xs, int64_t rows, const void *wp, int wdt, float *c,
        int64_t ldc, int accumulate, const float *bias, const char *pf, int64_t pf_lines) {
    v8f c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    v8f c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    const float *x0 = x, *x1 = x + (rows > 1) * xs, *x2 = x + (rows > 2) * 2 * xs;
    const float *x3 = x + (rows > 3) * 3 * xs, *x4 = x + (rows > 4) * 4 * xs;
    const float *x5 = x + (rows > 5) * 5 * xs;
    for (int64_t kk = 0; kk < kc; ++kk) {
        if (kk < pf_lines) __builtin_prefetch(pf + kk * 64);
        const v8f w0 = load_w8(wp, kk * NR, wdt), w1 = load_w8(wp, kk * NR + 8, wdt);
        v8f a = splat8(x0[kk]);
        c00 += a * w0, c01 += a * w1;
        a = splat8(x1[kk]), c10 += a * w0, c11 += a * w1;
        a = splat8(x2[kk]), c20 += a * w0, c21 += a * w1;
        a = splat8(x3[kk]), c30 += a * w0, c31 += a * w1;
        a = splat8(x4[kk]), c40 += a * w0, c41 += a * w1;
        a = splat8(x5[kk]), c50 += a * w0, c51 += a * w1;
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

/* Rows [0, mb) of x (row stride xs) times a weight panel of dtype wdt into y, KC values of k
 * at a time. The weight is read once, front to back (panels are contiguous), while each
 * micro-kernel prefetches its share of the next KC x 16 chunk. Edge tiles (fewer than 6 rows
 * or 16 columns) go through a 6 x 16 scratch tile. */
static inline __attribute__((always_inline)) void rows_times_panel(
        const float *x, int64_t xs, int64_t mb, int64_t k, const void *panel, int wdt,
        int64_t cols, const float *bias, float *y, int64_t y_stride) {
    float tile[MR * NR];
    const int64_t kernels = (mb + MR - 1) / MR, es = (int64_t)elem_size(wdt);
    const int64_t pf_lines = (KC * NR * es / 64 + kernels - 1) / kernels;
    for (int64_t pc = 0; pc < k; pc += KC) {
        const int64_t kc = min64(k - pc, KC);
        const char *wp = (const char *)panel + pc * NR * es, *next = wp + kc * NR * es;
        const float *init = pc == 0 ? bias : NULL;
        for (int64_t ir = 0; ir < mb; ir += MR) {
            const int64_t rows = min64(mb - ir, MR);
            const float *x_micro = x + ir * xs + pc;
            const char *pf = next + ir / MR * pf_lines * 64;
            float *c = y + ir * y_stride;
            if (rows == MR && cols == NR) {
                micro_kernel(kc, x_micro, xs, rows, wp, wdt, c, y_stride, pc > 0, init, pf,
                             pf_lines);
                continue;
            }
            micro_kernel(kc, x_micro, xs, rows, wp, wdt, tile, NR, 0, init, pf, pf_lines);
            for (int64_t i = 0; i < rows; ++i)
                for (int64_t j = 0; j < cols; ++j)
                    c[i * y_stride + j] = (pc > 0 ? c[i * y_stride + j] : 0.f) + tile[i * NR + j];
        }
    }
}

/* Rows of x per block: up to 96 rows of all of k, within ~256 KB (half this EPYC's L2). */
static int64_t block_rows(int64_t k) {
    const int64_t rows = (65536 / (k > 0 ? k : 1)) / MR * MR;
    return rows < MR ? MR : rows > MC ? MC : rows;
}

/* Rows [ic, ic + mb) of x times weight panel p (packed dtype wdt) into y (plus bias). */
static void block_times_panel(const float *x, int64_t x_stride, const void *packed, int wdt,
                              const float *bias, float *y, int64_t y_stride, int64_t ic,
                              int64_t mb, int64_t p, int64_t n, int64_t k) {
    const int64_t cols = min64(n - p * NR, NR);
    float *y_panel = y + ic * y_stride + p * NR, bias_tile[NR];
    if (bias)
        for (int64_t j = 0; j < NR; ++j) bias_tile[j] = j < cols ? bias[p * NR + j] : 0.f;
    if (k == 0) { /* an empty product is the bias (or zero) */
        for (int64_t i = 0; i < mb; ++i)
            for (int64_t j = 0; j < cols; ++j)
                y_panel[i * y_stride + j] = bias ? bias_tile[j] : 0.f;
        return;
    }
    const float *xb = x + ic * x_stride, *bt = bias ? bias_tile : NULL;
    const char *panel = (const char *)packed + p * k * NR * (int64_t)elem_size(wdt);
    /* one specialized copy of the loop nest per weight dtype */
    if (wdt == DT_BF16)
        rows_times_panel(xb, x_stride, mb, k, panel, DT_BF16, cols, bt, y_panel, y_stride);
    else if (wdt == DT_F16)
        rows_times_panel(xb, x_stride, mb, k, panel, DT_F16, cols, bt, y_panel, y_stride);
    else
        rows_times_panel(xb, x_stride, mb, k, panel, DT_F32, cols, bt, y_panel, y_stride);
}

/* A thread's share of the items, [front, back) packed into one word (front in the high 32
 * bits) so the owner (taking from the front) and a thief (taking from the back) claim items
 * with one compare-and-swap each and never take the same one. */
typedef struct {
    uint64_t range;
    char pad[56]; /* one cache line per share */
} Share;

/* Claims the next item of `share`: from the front (owner) or the back (thief). Returns the
 * item, or -1 when the share is empty. */
static int64_t claim(Share *share, int from_back) {
    uint64_t cur = __atomic_load_n(&share->range, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t front = cur >> 32, back = cur & 0xffffffffu;
        if (front >= back) return -1;
        const uint64_t next = from_back ? (front << 32) | (back - 1) : ((front + 1) << 32) | back;
        if (__atomic_compare_exchange_n(&share->range, &cur, next, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            return (int64_t)(from_back ? back - 1 : front);
    }
}

/* x [m, k] fp32 (row stride x_stride) @ a packed weight of dtype wdt (kvflow_gemm_pack or
 * kvflow_gemm_pack16 of [n, k]) + bias [n] (or NULL) -> y [m, n] fp32 (row stride y_stride).
 * Returns 1 when the work does not fit the item counter (more than 2^32 items) or scratch
 * cannot be allocated, else 0. */
static int gemm(const float *x, int64_t x_stride, const void *packed, int wdt,
                const float *bias, float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                int num_threads) {
    if (m <= 0 || n <= 0) return 0;
    const int64_t panels = (n + NR - 1) / NR, mb_max = block_rows(k);
    const int64_t blocks = (m + mb_max - 1) / mb_max;
    const int nt = num_threads < 1 ? 1 : (int64_t)num_threads > panels ? (int)panels : num_threads;
    if (blocks * panels >= ((int64_t)1 << 32)) return 1;
    Share *shares = aligned_alloc(64, sizeof(Share) * nt);
    if (!shares) return 1;
    /* Thread t's share: panels [p0, p1) for every x block, item = block * (p1 - p0) + p - p0. */
    for (int t = 0; t < nt; ++t)
        shares[t].range = (uint64_t)(blocks * (panels * (t + 1) / nt - panels * t / nt));
#pragma omp parallel num_threads(nt)
    {
        const int self = omp_get_thread_num();
        for (int i = 0; i < nt; ++i) {
            const int t = (self + i) % nt; /* own share first, then the others' */
            const int64_t p0 = panels * t / nt, width = panels * (t + 1) / nt - p0;
            for (int64_t item; (item = claim(&shares[t], t != self)) >= 0;) {
                const int64_t ic = item / width * mb_max;
                block_times_panel(x, x_stride, packed, wdt, bias, y, y_stride, ic,
                                  min64(m - ic, mb_max), p0 + item % width, n, k);
            }
        }
    }
    free(shares);
    return 0;
}

/* fp32 weights (kvflow_gemm_pack); see gemm(). */
int kvflow_gemm(const float *x, int64_t x_stride, const float *packed, const float *bias,
                float *y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int num_threads) {
    return gemm(x, x_stride, packed, DT_F32, bias, y, y_stride, m, n, k, num_threads);
}

/* bf16 (wdt 1) or fp16 (wdt 2) weights (kvflow_gemm_pack16), fp32 x and y; see gemm(). */
int kvflow_gemm_w16(const float *x, int64_t x_stride, const uint16_t *packed, int wdt,
                    const float *bias, float *y, int64_t y_stride, int64_t m, int64_t n,
                    int64_t k, int num_threads) {
    if (wdt != DT_BF16 && wdt != DT_F16) return 1;
    return gemm(x, x_stride, packed, wdt, bias, y, y_stride, m, n, k, num_threads);
}
