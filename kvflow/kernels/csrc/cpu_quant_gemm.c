/*
 * Weight-only INT8 GEMM for few activation rows (decode), fp32 accumulation:
 * y[i, j] = scale[j] * (x[i, :] . q[j, :]) + bias[j], with q the int8 weight [n, k] in its
 * plain row-major layout (the one torch's _weight_int8pack_mm and the INT8 embedding lookup
 * read, so no second copy is kept) and scale the per-output-channel fp32 scale
 * (kvflow/quant/int8.py's absmax rule).
 *
 * At batch 1 a linear layer is bound by reading its weight: int8 is half of bf16's bytes, so a
 * GEMV that keeps up with memory runs up to twice as fast. Each weight vector is loaded as
 * int8 and widened in registers (exact), never stored wider:
 *   - fp32 path: widened to fp32 (sign extension + conversion) and multiplied with fp32
 *     activations by FMA;
 *   - bf16 path (AVX512-BF16 builds, bf16 activations, 2+ rows): 32 weights widened to bf16
 *     (exact: |q| <= 127 fits bf16's 8-bit significand) and multiplied with the bf16
 *     activations as they are by VDPBF16PS (two products added into each fp32 lane per
 *     instruction, Intel SDM vol. 2), half the multiply instructions of the fp32 path; the
 *     products are exact, so the result is the fp32 path's up to summation order. Measured on
 *     the 2-core EPYC (one thread, SmolLM2's shapes, alternating builds): 1.1x faster at 2
 *     rows, 1.4-2.3x at 8, 1.7-2.1x at 64, but 1.2-1.3x slower at one row (its widening costs
 *     more than the multiplies it saves), so one row takes the fp32 path.
 * R output rows are multiplied at once against MB activation rows (R x MB accumulators held in
 * registers, R chosen per MB so enough independent chains hide the multiply latency), so each
 * widened weight vector serves MB activation rows; more rows re-read the R weight rows from L1
 * for each block of MB rows.
 *
 * Summation order: every output element has VW fp32 partial sums (fp32 path: lane l takes
 * k = l mod VW; bf16 path: lane l takes the pairs 2l, 2l + 1 mod 32), reduced by a fixed tree,
 * then a scalar tail (k mod VW or 32), then the scale and bias. The order depends only on k,
 * the build and the path, never on which rows share a micro-kernel or on the thread count: a
 * row's result is bitwise the same whatever else is in the batch, except that with bf16
 * activations on AVX512-BF16 a one-row call (fp32 path) and a call of more rows (bf16 path)
 * sum in different orders.
 *
 * Group scales (GPTQ 8-bit, compressed-tensors W8A16 group strategy: scale [n, k / G], one per G
 * consecutive input columns of a row): y[i, j] = sum_g scale[j, g] * (x[i, group g] . q[j,
 * group g]) + bias[j]. Each group's partial dot products are accumulated lane-wise as above
 * (its own VW- or 32-value steps, then its scalar tail), multiplied by the group's scale and
 * added into a second set of lane accumulators (one FMA per lane), so the horizontal sum runs
 * once per output, not once per group; the accumulator pairs halve the rows per micro-kernel.
 * The order again depends only on k, G, the build and the path.
 *
 * Vector code is written with GCC/Clang vector extensions (byte widening with AVX2/AVX512
 * intrinsics: GCC 12 widens byte vectors one lane at a time), so the same source is each ISA
 * level's kernel (cpu_build.py): VW = 16 (one zmm) in AVX512 builds, 8 (one ymm, or two SSE
 * registers in the baseline build) otherwise. Work is split over OpenMP threads (torch's
 * runtime) in chunks of ITEM_ROWS output rows taken dynamically, so a thread descheduled on a
 * shared machine leaves its remaining chunks to the others.
 */
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "cpu_entry_points.h"

#if defined(__AVX512F__)
#define VW 16
#define ACC_REGS 16 /* of 32 vector registers */
#else
#define VW 8
#define ACC_REGS 8 /* of 16 */
#endif
#if defined(__AVX512BF16__)
#define BF16_DP 1
#else
#define BF16_DP 0
#endif
#define MB_MAX 8      /* activation rows per micro-kernel */
#define ITEM_ROWS 16  /* output rows per work item */
#define PF_GROUPS 2   /* micro-kernels ahead that prefetching reads */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef int8_t vb __attribute__((vector_size(VW)));

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* VW int8 weights at p, widened to fp32 (exact): one sign-extending load and one conversion. */
static inline vf load_i8(const int8_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
#elif defined(__AVX2__)
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p)));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    const vf f = __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
    vf v;
    memcpy(&v, &f, sizeof v);
    return v;
}

/* The lane sum of v by a fixed tree: halves added until one lane is left. */
static inline float hsum_vf(vf v) {
#if VW == 16
    v8f s;
    {
        v8f lo, hi;
        memcpy(&lo, &v, 32);
        memcpy(&hi, (const char *)&v + 32, 32);
        s = lo + hi;
    }
#else
    v8f s = v;
#endif
    const v4f a = (v4f){s[0], s[1], s[2], s[3]} + (v4f){s[4], s[5], s[6], s[7]};
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* Weight rows per micro-kernel for mb activation rows: R x mb accumulators within regs
 * (ACC_REGS, or half of it with group scales: two accumulators per output), up to 8
 * independent chains at one row. */
static inline int rows_for(int regs, int mb) {
    const int r = regs / mb;
    return r >= 8 ? 8 : r >= 4 ? 4 : r >= 2 ? 2 : 1;
}

/* acc[r][i] += q[r, k0:k1] . x[i, k0:k1] lane by lane (k1 - k0 a multiple of VW) for R weight
 * rows (row stride qs) and MB fp32 activation rows (row stride xs). R and MB are compile-time
 * constants wherever this is inlined. Meanwhile the R rows at pf (PF_GROUPS
 * micro-kernels ahead, NULL for none) are prefetched into L2 (prefetcht1), one cache line per
 * row every 64 values of k. Measured on the 2-core AVX512 EPYC (49152 x 576, one thread,
 * alternating builds): no software prefetch 1.3x slower than prefetcht0 one micro-kernel
 * ahead, which was 1.6x slower than prefetcht1 two ahead (1, 4, 8, 16 ahead within 10% of 2;
 * prefetchnta 2x slower). */
static inline __attribute__((always_inline)) void lanes_fp32(
        int R, int MB, const float *x, int64_t xs, const int8_t *q, int64_t qs, int64_t k0,
        int64_t k1, const int8_t *pf, vf acc[8][MB_MAX]) {
    for (int64_t kk = k0; kk < k1; kk += VW) {
        if (pf && kk % 64 == 0)
            for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * qs + kk, 0, 2);
        for (int r = 0; r < R; ++r) {
            const vf w = load_i8(q + r * qs + kk);
            for (int i = 0; i < MB; ++i) acc[r][i] += w * load_vf(x + i * xs + kk);
        }
    }
}

/* The scalar tail q[k0:k1] . x[k0:k1], summed in k order. */
static inline float tail_fp32(const float *x, const int8_t *q, int64_t k0, int64_t k1) {
    float tail = 0.f;
    for (int64_t kk = k0; kk < k1; ++kk) tail += (float)q[kk] * x[kk];
    return tail;
}

/* dots[r][i] = q[r, :] . x[i, :]: VW-lane accumulators, the fixed tree, then the scalar
 * tail (k mod VW). */
static inline __attribute__((always_inline)) void dot_block(
        int R, int MB, const float *x, int64_t xs, const int8_t *q, int64_t qs, int64_t k,
        const int8_t *pf, float dots[8][MB_MAX]) {
    vf acc[8][MB_MAX];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) acc[r][i] = (vf){0};
    const int64_t kv = k / VW * VW;
    lanes_fp32(R, MB, x, xs, q, qs, 0, kv, pf, acc);
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i)
            dots[r][i] = hsum_vf(acc[r][i]) + tail_fp32(x + i * xs, q + r * qs, kv, k);
}

/* As dot_block with group scales s (row stride ss, one per G columns): dots[r][i] = sum_g
 * s[r, g] * (q[r, group g] . x[i, group g]), the scales applied lane-wise per group (see the
 * header). */
static inline __attribute__((always_inline)) void dot_block_grouped(
        int R, int MB, const float *x, int64_t xs, const int8_t *q, int64_t qs, int64_t k,
        int64_t G, const float *s, int64_t ss, const int8_t *pf, float dots[8][MB_MAX]) {
    vf acc[8][MB_MAX], tot[8][MB_MAX];
    float tails[8][MB_MAX];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) tot[r][i] = (vf){0}, tails[r][i] = 0.f;
    const int64_t gv = G / VW * VW;
    for (int64_t g0 = 0, g = 0; g0 < k; g0 += G, ++g) {
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < MB; ++i) acc[r][i] = (vf){0};
        lanes_fp32(R, MB, x, xs, q, qs, g0, g0 + gv, pf, acc);
        for (int r = 0; r < R; ++r) {
            const float sc = s[r * ss + g];
            const vf sv = (vf){0} + sc;
            for (int i = 0; i < MB; ++i) {
                tot[r][i] += acc[r][i] * sv;
                if (gv < G)
                    tails[r][i] += tail_fp32(x + i * xs, q + r * qs, g0 + gv, g0 + G) * sc;
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) dots[r][i] = hsum_vf(tot[r][i]) + tails[r][i];
}

#if BF16_DP
/* 32 int8 weights at p as bf16 pairs in k order (exact). */
static inline __m512bh load_i8_bf16(const int8_t *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo); /* elements 0-15 from lo, 16-31 from hi */
}

static inline float bf16_at(const uint16_t *p) {
    const uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* lanes_fp32 for bf16 activation rows: 32 values of k per VDPBF16PS. */
static inline __attribute__((always_inline)) void lanes_dp(
        int R, int MB, const uint16_t *x, int64_t xs, const int8_t *q, int64_t qs, int64_t k0,
        int64_t k1, const int8_t *pf, __m512 acc[8][MB_MAX]) {
    for (int64_t kk = k0; kk < k1; kk += 32) {
        if (pf && kk % 64 == 0)
            for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * qs + kk, 0, 2);
        for (int r = 0; r < R; ++r) {
            const __m512bh w = load_i8_bf16(q + r * qs + kk);
            for (int i = 0; i < MB; ++i)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w,
                                             (__m512bh)_mm512_loadu_si512(x + i * xs + kk));
        }
    }
}

static inline float tail_bf16(const uint16_t *x, const int8_t *q, int64_t k0, int64_t k1) {
    float tail = 0.f;
    for (int64_t kk = k0; kk < k1; ++kk) tail += (float)q[kk] * bf16_at(x + kk);
    return tail;
}

static inline float hsum_m512(__m512 a) {
    vf v;
    memcpy(&v, &a, sizeof v);
    return hsum_vf(v);
}

/* As dot_block for bf16 activation rows x (uint16, row stride xs elements): 32 values of k per
 * VDPBF16PS, the tail (k mod 32) in scalar fp32. */
static inline __attribute__((always_inline)) void dot_block_dp(
        int R, int MB, const uint16_t *x, int64_t xs, const int8_t *q, int64_t qs, int64_t k,
        const int8_t *pf, float dots[8][MB_MAX]) {
    __m512 acc[8][MB_MAX];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
    const int64_t kv = k / 32 * 32;
    lanes_dp(R, MB, x, xs, q, qs, 0, kv, pf, acc);
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i)
            dots[r][i] = hsum_m512(acc[r][i]) + tail_bf16(x + i * xs, q + r * qs, kv, k);
}

/* dot_block_grouped on the bf16 path (G a multiple of 32: no tails). */
static inline __attribute__((always_inline)) void dot_block_dp_grouped(
        int R, int MB, const uint16_t *x, int64_t xs, const int8_t *q, int64_t qs, int64_t k,
        int64_t G, const float *s, int64_t ss, const int8_t *pf, float dots[8][MB_MAX]) {
    __m512 acc[8][MB_MAX], tot[8][MB_MAX];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) tot[r][i] = _mm512_setzero_ps();
    for (int64_t g0 = 0, g = 0; g0 < k; g0 += G, ++g) {
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
        lanes_dp(R, MB, x, xs, q, qs, g0, g0 + G, pf, acc);
        for (int r = 0; r < R; ++r) {
            const __m512 sv = _mm512_set1_ps(s[r * ss + g]);
            for (int i = 0; i < MB; ++i) tot[r][i] = _mm512_fmadd_ps(acc[r][i], sv, tot[r][i]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) dots[r][i] = hsum_m512(tot[r][i]);
}
#endif

/* The micro-kernel for R in {8, 4, 2, 1} and MB in 1..MB_MAX, each a specialized copy: the
 * bf16 path for bf16 x where built, else the fp32 path; per channel (s NULL) or with group
 * scales s (G columns each, row stride ss). */
static void dot_block_any(int R, int MB, int dp, const void *x, int64_t xs, const int8_t *q,
                          int64_t qs, int64_t k, int64_t G, const float *s, int64_t ss,
                          const int8_t *pf, float dots[8][MB_MAX]) {
#if BF16_DP
#define CALL(RR, MM)                                                                       \
    (s ? (dp ? dot_block_dp_grouped(RR, MM, x, xs, q, qs, k, G, s, ss, pf, dots)           \
             : dot_block_grouped(RR, MM, x, xs, q, qs, k, G, s, ss, pf, dots))             \
       : dp ? dot_block_dp(RR, MM, x, xs, q, qs, k, pf, dots)                              \
            : dot_block(RR, MM, x, xs, q, qs, k, pf, dots))
#else
    (void)dp;
#define CALL(RR, MM)                                                                       \
    (s ? dot_block_grouped(RR, MM, x, xs, q, qs, k, G, s, ss, pf, dots)                    \
       : dot_block(RR, MM, x, xs, q, qs, k, pf, dots))
#endif
#define CASE_MB(RR)                                                                        \
    switch (MB) {                                                                          \
    case 1: CALL(RR, 1); break;                                                            \
    case 2: CALL(RR, 2); break;                                                            \
    case 3: CALL(RR, 3); break;                                                            \
    case 4: CALL(RR, 4); break;                                                            \
    case 5: CALL(RR, 5); break;                                                            \
    case 6: CALL(RR, 6); break;                                                            \
    case 7: CALL(RR, 7); break;                                                            \
    default: CALL(RR, 8); break;                                                           \
    }
    switch (R) {
    case 8: CASE_MB(8); break;
    case 4: CASE_MB(4); break;
    case 2: CASE_MB(2); break;
    default: CASE_MB(1); break;
    }
#undef CASE_MB
#undef CALL
}

typedef struct {
    const void *x; /* fp32, or bf16 on the bf16 path */
    int64_t xs;
    int dp; /* the bf16 path */
    const int8_t *q;
    int64_t qs;
    const float *scale, *bias; /* scale [n] per channel, or [n, k / group] */
    int64_t group;             /* columns per scale; 0: per channel */
    void *y;
    int64_t ys;
    int ydt;
    int64_t m, n, k;
} Int8Gemm;

/* y[i, j] for output rows [j0, j0 + rows) and every activation row. */
static void item_rows(const Int8Gemm *g, int64_t j0, int64_t rows) {
    const size_t yes = elem_size(g->ydt), xes = g->dp ? 2 : 4;
    float dots[8][MB_MAX];
    for (int64_t i0 = 0; i0 < g->m; i0 += MB_MAX) {
        const int mb = (int)(g->m - i0 < MB_MAX ? g->m - i0 : MB_MAX);
        const int r_full = rows_for(g->group ? ACC_REGS / 2 : ACC_REGS, mb);
        const int64_t ss = g->group ? g->k / g->group : 0; /* scale row stride */
        for (int64_t j = j0; j < j0 + rows;) {
            const int r = j0 + rows - j >= r_full ? r_full : 1;
            /* prefetch the rows PF_GROUPS micro-kernels ahead on the first pass over these
             * (later passes find them in cache) */
            const int8_t *pf = i0 == 0 && j + (PF_GROUPS + 1) * r <= g->n
                ? g->q + (j + PF_GROUPS * r) * g->qs : NULL;
            dot_block_any(r, mb, g->dp, (const char *)g->x + i0 * g->xs * xes, g->xs,
                          g->q + j * g->qs, g->qs, g->k, g->group,
                          g->group ? g->scale + j * ss : NULL, ss, pf, dots);
            for (int i = 0; i < mb; ++i)
                for (int rr = 0; rr < r; ++rr) {
                    const float d = g->group ? dots[rr][i] : dots[rr][i] * g->scale[j + rr];
                    const float v = d + (g->bias ? g->bias[j + rr] : 0.f);
                    store_row(g->ydt, &v, (char *)g->y + ((i0 + i) * g->ys + j + rr) * yes, 1);
                }
            j += r;
        }
    }
}

/* kvflow_int8_gemm and kvflow_int8_gemm_grouped: group 0 per channel. bf16 x of 2+ rows takes
 * the bf16 path where built (with groups: when group is a multiple of 32); other 16-bit x is
 * widened to fp32 first (exact). Returns 1 when that fp32 copy cannot be allocated. */
static int int8_gemm(const void *x, int64_t xs, int xdt, const int8_t *q, int64_t qs,
                     const float *scale, int64_t group, const float *bias, void *y, int64_t ys,
                     int ydt, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (m <= 0 || n <= 0) return 0;
    const int dp = BF16_DP && xdt == DT_BF16 && m >= 2 && group % 32 == 0;
    float *x32 = NULL;
    if (xdt != DT_F32 && !dp) {
        x32 = malloc(sizeof(float) * (size_t)(m * (k > 0 ? k : 1)));
        if (!x32) return 1;
        for (int64_t i = 0; i < m; ++i)
            load_row(xdt, (const char *)x + i * xs * (int64_t)elem_size(xdt), x32 + i * k, k);
    }
    const Int8Gemm g = {x32 ? (const void *)x32 : x, x32 ? k : xs, dp, q, qs, scale, bias,
                        group, y, ys, ydt, m, n, k};
    const int64_t items = (n + ITEM_ROWS - 1) / ITEM_ROWS;
    const int nt = num_threads < 1 ? 1 : (int64_t)num_threads > items ? (int)items : num_threads;
    const int64_t chunk = items / (4 * (int64_t)nt) > 0 ? items / (4 * (int64_t)nt) : 1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, chunk) if (nt > 1)
    for (int64_t t = 0; t < items; ++t) {
        const int64_t j0 = t * ITEM_ROWS;
        item_rows(&g, j0, n - j0 < ITEM_ROWS ? n - j0 : ITEM_ROWS);
    }
    free(x32);
    return 0;
}

/* y [m, n] (dtype ydt, row stride ys) = (x [m, k] (dtype xdt, row stride xs) @ q^T) * scale
 * (+ bias), q int8 [n, k] (row stride qs), scale and bias fp32 [n] (bias may be NULL).
 * Returns 1 when the fp32 copy of 16-bit x cannot be allocated, else 0. */
int kvflow_int8_gemm(const void *x, int64_t xs, int xdt, const int8_t *q, int64_t qs,
                     const float *scale, const float *bias, void *y, int64_t ys, int ydt,
                     int64_t m, int64_t n, int64_t k, int num_threads) {
    return int8_gemm(x, xs, xdt, q, qs, scale, 0, bias, y, ys, ydt, m, n, k, num_threads);
}

/* As kvflow_int8_gemm with group scales: y[i, j] = sum_g scale[j, g] * (x[i, gG:(g+1)G] .
 * q[j, gG:(g+1)G]) (+ bias[j]), scale fp32 [n, k / group] contiguous. Returns 2 when group
 * is not positive or does not divide k (nothing written), 1 as kvflow_int8_gemm, else 0. */
int kvflow_int8_gemm_grouped(const void *x, int64_t xs, int xdt, const int8_t *q, int64_t qs,
                             const float *scale, int64_t group, const float *bias, void *y,
                             int64_t ys, int ydt, int64_t m, int64_t n, int64_t k,
                             int num_threads) {
    if (group <= 0 || k % group) return 2;
    return int8_gemm(x, xs, xdt, q, qs, scale, group, bias, y, ys, ydt, m, n, k, num_threads);
}
