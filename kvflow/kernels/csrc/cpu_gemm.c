/*
 * GEMM against a weight packed once: y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]), fp32 result.
 *
 * The layout and loop nest follow Goto & van de Geijn, "Anatomy of High-Performance Matrix
 * Multiplication" (ACM TOMS 2008), as BLIS arranges it (Van Zee & van de Geijn 2015):
 *
 *   - the weight is packed once, after loading, into panels of NR output columns stored
 *     k-major ([ceil(n/NR)][k][NR], zero-padded), so the micro-kernel reads it with unit
 *     stride. NR is 16 (two 8-lane vectors) in AVX2 and baseline builds, 32 (two 16-lane
 *     vectors) in AVX512 builds (cpu_build.py builds one library per ISA level);
 *   - x is read in place, in blocks of up to MC = 96 rows (at most 256 KB, so a block stays in
 *     L2 while every panel of the weight passes over it). Goto packs x as well, to make its
 *     reads unit-stride; here the micro-kernel reads its row streams in place instead, which
 *     measured equal or faster (on AMD Zen) and leaves no per-call packing or scratch memory.
 *     On Ice Lake server cores (kvflow_gemm_x_packed) blocks of more than MR (16-bit weights)
 *     or MR_BALANCED (fp32 weights) rows of fp32 x are packed after all, k-major per micro-kernel, each thread packing a block once into
 *     its own scratch, for micro-kernels of up to MR_PACKED = 12 rows, over the same k chunks
 *     (so each output is the same sum, bit for bit, packed or not, whatever the row count):
 *     1.1-1.2x faster there from 64 rows up (docs/benchmarks.md, session 51);
 *   - the micro-kernel multiplies up to MR rows x KC of x by a KC x NR micro-panel of the
 *     weight (kept in L1 across the micro-kernels of a block) into rows x NR accumulators held
 *     in registers (2 vectors per row), two weight loads and one broadcast per row per k. How
 *     many rows each micro-kernel takes depends on the block's row count (kernel_rows): a
 *     decode-sized block runs as few micro-kernels as the registers allow, because only the
 *     first reads the weight from memory and the memory stream stalls while the others re-read
 *     it from L1. Each row count runs a copy specialized for it, instead of computing rows that
 *     are thrown away.
 *
 * Weight dtypes (wdt): fp32; fp16 and bf16 kept 16-bit in the panels and widened to fp32 in
 * registers as they are loaded (exact), with fp32 x. In builds with AVX512-BF16
 * (__AVX512BF16__), bf16 weights are instead packed in k-pairs ([panel][k/2][32][2], the
 * operand layout of VDPBF16PS, Intel SDM vol. 2) and multiplied with bf16 x by VDPBF16PS,
 * which adds two bf16 products to each fp32 lane per instruction: twice the multiply rate of
 * fp32 FMA and half the weight bytes. kvflow_gemm_x_dtype says which x a weight dtype takes:
 * bf16 weights take bf16 x in every build. Where they are widened (no AVX512-BF16: Ice Lake,
 * AVX2), x is widened to fp32 inside the call (exact): a few rows on the stack; more, where x
 * is packed (kvflow_gemm_x_packed), by each thread as it packs a block, elsewhere all of x
 * into scratch first (kvflow_gemm): a bf16 model's activations then reach the GEMM as they
 * are, with no conversion between the native calls of a decode step (a torch conversion there
 * made every step unreplayable as a CPU step graph, kvflow/worker/cpu_graphs.py). The weights
 * are widened in registers by every micro-kernel: widening each chunk once per block into an
 * fp32 buffer for the block's micro-kernels measured 0.8-1.0x on an Ice Lake Xeon
 * (docs/benchmarks.md, session 52), the kernel not being bound by the widening there.
 * In builds with AMX-BF16 (__AMX_BF16__) the same k-paired panels are multiplied by AMX tiles
 * instead (cpu_gemm_amx.h) where k is a multiple of 32, in x blocks of 256 rows walked in k
 * chunks, x packed in tile order from 48 rows.
 * Accumulation and the result are fp32 everywhere (the LM head of a 16-bit model keeps its
 * logits fp32; other layers round once, afterwards).
 *
 * Work is split into (x block, weight panel) items. Thread t owns a contiguous share of the
 * panels and walks it front to back for every x block (so each thread streams its share of the
 * weight in order); a thread that finishes early takes the remaining items from the back of
 * another thread's share. On a shared machine one core often runs slower than the other for a
 * while, and a fixed split would leave the fast one waiting. Every output element is still
 * computed by one thread in one fixed k order, so results do not depend on the thread count or
 * on which thread ran an item. Threads come from torch's OpenMP runtime (see cpu_attention.c).
 */
#include "cpu_common.h"
#include "cpu_entry_points.h"
#include "cpu_pool.h"

#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
enum { NR = 32 };
typedef float vhf __attribute__((vector_size(64))); /* half a panel row: 16 floats */
typedef uint16_t vhu16 __attribute__((vector_size(32)));
typedef uint32_t vhu32 __attribute__((vector_size(64)));
typedef _Float16 vhh __attribute__((vector_size(32)));
#else
enum { NR = 16 };
typedef float vhf __attribute__((vector_size(32))); /* half a panel row: 8 floats */
typedef uint16_t vhu16 __attribute__((vector_size(16)));
typedef uint32_t vhu32 __attribute__((vector_size(32)));
typedef _Float16 vhh __attribute__((vector_size(16)));
#endif
/* MR: the most rows of one micro-kernel; MR_FULL: rows per micro-kernel in blocks of more than
 * MR_BALANCED rows (see kernel_rows), for k-paired bf16 MR instead where the core has two
 * full-width 512-bit pipes (kvflow_gemm_full_rows); PF_ONE_PASS: whether a block of one
 * micro-kernel prefetches (block_panel). AVX512 has 32 vector registers: 8 rows x 2
 * accumulators. AVX2 builds keep the layout they were tuned with on a Zen 3 EPYC (not
 * re-measured there). */
#if defined(__AVX512F__)
enum { MR = 8, MR_FULL = 6, MR_BALANCED = 32, PF_ONE_PASS = 0, MR_PACKED = 12 };
#else
enum { MR = 6, MR_FULL = 6, MR_BALANCED = 0, PF_ONE_PASS = 1, MR_PACKED = 0 };
#endif
/* MR_PACKED: the most rows of a micro-kernel that reads fp32 x packed k-major
 * (kvflow_gemm_x_packed). */
enum { MR_MAX = MR_PACKED > MR ? MR_PACKED : MR };
enum { HALF = NR / 2, KC = 256, MC = 96 };

#if defined(__AVX512BF16__)
#define BF16_PAIRS 1
#else
#define BF16_PAIRS 0
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The dtype of x a weight of dtype wdt is multiplied with: bf16 for bf16 weights (k-paired
 * panels take it as it is, widened panels widen it inside the call: widen_x, pack_x_block),
 * else fp32. */
int kvflow_gemm_x_dtype(int wdt) { return wdt == DT_BF16 ? DT_BF16 : DT_F32; }

/* Whether x of dtype xdt is widened to fp32 before the products (bf16 x of widened panels). */
static inline int widens_x(int xdt) { return xdt == DT_BF16 && !BF16_PAIRS; }

/* rows rows of bf16 x (row stride xs elements) widened into fp32 x32 [rows, k] (row stride
 * k): exact, bf16 being the top half of fp32. */
static void widen_x(const uint16_t *x, int64_t xs, float *x32, int64_t k, int64_t rows) {
    for (int64_t i = 0; i < rows; ++i) load_row(DT_BF16, x + i * xs, x32 + i * k, k);
}

/* Columns per panel of this build (16 or 32). */
int kvflow_gemm_panel_width(void) { return NR; }

/* Elements of the packed form of an [n, k] weight (k rounded up to even for k-pairs). */
int64_t kvflow_gemm_packed_size(int64_t n, int64_t k, int wdt) {
    const int64_t kk = wdt == DT_BF16 && BF16_PAIRS ? (k + 1) / 2 * 2 : k;
    return (n + NR - 1) / NR * NR * kk;
}

/* Offset (elements) of weight element (column j of the panel, depth kk) within a panel. */
static inline int64_t packed_offset(int64_t j, int64_t kk, int paired) {
    return paired ? (kk / 2) * (2 * NR) + 2 * j + kk % 2 : kk * NR + j;
}

/* w [n, k] of dtype wdt (row stride w_stride elements) -> packed (see the header), zero-padded
 * columns and (k-pairs) depth. */
void kvflow_gemm_pack(const void *w, int64_t w_stride, int64_t n, int64_t k, int wdt,
                      void *packed, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR, es = (int64_t)elem_size(wdt);
    const int paired = wdt == DT_BF16 && BF16_PAIRS;
    const int64_t kk_n = paired ? (k + 1) / 2 * 2 : k;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        char *dst = (char *)packed + p * kk_n * NR * es;
        for (int64_t j = 0; j < NR; ++j) {
            const int64_t col = p * NR + j;
            for (int64_t kk = 0; kk < kk_n; ++kk) {
                char *d = dst + packed_offset(j, kk, paired) * es;
                if (col < n && kk < k)
                    memcpy(d, (const char *)w + (col * w_stride + kk) * es, (size_t)es);
                else
                    memset(d, 0, (size_t)es);
            }
        }
    }
}

/* Rows ids [m] (int64) of the weight packed by kvflow_gemm_pack ([n, k] of dtype wdt) -> out
 * [m, k] (row stride out_stride elements), bit for bit the weight's rows: an embedding lookup
 * from a tied LM head's packed copy. One thread (a few hundred bytes per row). Returns 2 when an
 * id lies outside [0, n) (nothing past it is written), else 0. */
int kvflow_gemm_rows(const void *packed, int wdt, int64_t n, int64_t k, const int64_t *ids,
                     int64_t m, void *out, int64_t out_stride) {
    const int64_t es = (int64_t)elem_size(wdt);
    const int paired = wdt == DT_BF16 && BF16_PAIRS;
    const int64_t kk_n = paired ? (k + 1) / 2 * 2 : k;
    for (int64_t t = 0; t < m; ++t) {
        const int64_t id = ids[t];
        if (id < 0 || id >= n) return 2;
        const char *panel = (const char *)packed + id / NR * kk_n * NR * es;
        char *row = (char *)out + t * out_stride * es;
        for (int64_t kk = 0; kk < k; ++kk)
            memcpy(row + kk * es, panel + packed_offset(id % NR, kk, paired) * es, (size_t)es);
    }
    return 0;
}

/* HALF weight values at element i of a (non-paired) panel of dtype wdt, widened to fp32. */
static inline __attribute__((always_inline)) vhf load_w(const void *wp, int64_t i, int wdt) {
    vhf f;
    if (wdt == DT_F32) {
        memcpy(&f, (const float *)wp + i, sizeof f);
        return f;
    }
#if defined(__AVX512F__)
    if (wdt == DT_BF16) { /* one VPMOVZXWD from memory and a shift: bf16 = the top half of fp32 */
        const __m512i u = _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)((const uint16_t *)wp + i))), 16);
        memcpy(&f, &u, sizeof f);
        return f;
    }
#endif
    vhu16 h;
    memcpy(&h, (const uint16_t *)wp + i, sizeof h);
    if (wdt == DT_F16) {
        vhh v;
        memcpy(&v, &h, sizeof v);
        return __builtin_convertvector(v, vhf);
    }
    const vhu32 u = __builtin_convertvector(h, vhu32) << 16; /* bf16 = the top half of fp32 */
    memcpy(&f, &u, sizeof f);
    return f;
}

/* s in every lane: one broadcast load. (`(vhf){0} + s` cost a vaddss per row and k step
 * beside the two FMAs, on the same ports: 0 + s is not s for s = -0.0, so the compiler must
 * add; s - 0 is s for every s, so it folds away.) */
static inline vhf splat(float s) { return s - (vhf){0}; }

static inline void store_tile_row(float *row, vhf lo, vhf hi, int accumulate, const float *init) {
    vhf a, b;
    if (accumulate) {
        memcpy(&a, row, sizeof a);
        memcpy(&b, row + HALF, sizeof b);
    } else if (init) {
        memcpy(&a, init, sizeof a);
        memcpy(&b, init + HALF, sizeof b);
    } else {
        a = b = (vhf){0};
    }
    a += lo, b += hi;
    memcpy(row, &a, sizeof a);
    memcpy(row + HALF, &b, sizeof b);
}

/* Prefetches cache lines [from, to) (64 bytes each) of pf: into L1, or into L2 only when l2. */
static inline __attribute__((always_inline)) void prefetch_lines(const char *pf, int64_t from,
                                                                 int64_t to, int l2) {
    for (int64_t l = from; l < to; ++l)
        if (l2) __builtin_prefetch(pf + l * 64, 0, 2);
        else __builtin_prefetch(pf + l * 64);
}

/* c[R][NR] (row stride ldc) = init + x[R rows (stride xs)][kc] @ wp[kc][NR] for R (a
 * compile-time constant wherever this is inlined) rows of fp32 x (xpacked: x packed k-major,
 * x[kc][R], xs unused); init is c itself
 * (accumulate), bias (NR values) or zero (bias NULL). Meanwhile prefetches pf_lines cache lines
 * (64 bytes each) from pf, the weight chunk the next micro-kernels will read: into L1, or into
 * L2 only when pf_l2 (block_panel says when). */
static inline __attribute__((always_inline)) void micro_kernel(
        int R, int64_t kc, const float *x, int64_t xs, const void *wp, int wdt, float *c,
        int64_t ldc, int accumulate, const float *bias, const char *pf, int64_t pf_lines,
        int pf_l2, int xpacked) {
    vhf acc[MR_MAX][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = (vhf){0};
    const int64_t pf_per_k = kc > 0 ? (pf_lines + kc - 1) / kc : 0; /* lines per k step */
    for (int64_t kk = 0; kk < kc; ++kk) {
        prefetch_lines(pf, kk * pf_per_k, min64((kk + 1) * pf_per_k, pf_lines), pf_l2);
        const vhf w0 = load_w(wp, kk * NR, wdt), w1 = load_w(wp, kk * NR + HALF, wdt);
        for (int r = 0; r < R; ++r) {
            const vhf a = splat(xpacked ? x[kk * R + r] : x[r * xs + kk]);
            acc[r][0] += a * w0;
            acc[r][1] += a * w1;
        }
    }
    for (int r = 0; r < R; ++r) store_tile_row(c + r * ldc, acc[r][0], acc[r][1], accumulate, bias);
}

#if BF16_PAIRS
/* As micro_kernel, for bf16 x (row stride xs elements) and a k-paired bf16 panel: one
 * VDPBF16PS per row and half panel adds the products of two k values. An odd kc (the last
 * chunk of an odd k) ends with a pair whose second x value is zero. */
static inline __attribute__((always_inline)) void micro_kernel_dp(
        int R, int64_t kc, const uint16_t *x, int64_t xs, const uint16_t *wp, float *c,
        int64_t ldc, int accumulate, const float *bias, const char *pf, int64_t pf_lines,
        int pf_l2) {
    __m512 acc[MR][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t pairs = kc / 2, pf_per_k = pairs > 0 ? (pf_lines + pairs - 1) / pairs : 0;
    for (int64_t kp = 0; kp < pairs; ++kp) {
        prefetch_lines(pf, kp * pf_per_k, min64((kp + 1) * pf_per_k, pf_lines), pf_l2);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + kp * 2 * NR);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + kp * 2 * NR + NR);
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            memcpy(&pair, x + r * xs + 2 * kp, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        }
    }
    if (kc % 2) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + pairs * 2 * NR);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + pairs * 2 * NR + NR);
        for (int r = 0; r < R; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int32_t)x[r * xs + kc - 1]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        }
    }
    for (int r = 0; r < R; ++r) {
        vhf lo, hi;
        memcpy(&lo, &acc[r][0], sizeof lo);
        memcpy(&hi, &acc[r][1], sizeof hi);
        store_tile_row(c + r * ldc, lo, hi, accumulate, bias);
    }
}
#endif

/* The cases R = 1..6 of a row-count switch (every build's MR is at least 6). */
#define ROW_CASES_1_TO_6(CALL)                                                              \
    case 1: CALL(1); break;                                                                 \
    case 2: CALL(2); break;                                                                 \
    case 3: CALL(3); break;                                                                 \
    case 4: CALL(4); break;                                                                 \
    case 5: CALL(5); break;                                                                 \
    case 6: CALL(6); break;

/* One micro-kernel call of R rows, R = 1..MR dispatched to a specialized copy. */
#define FOR_ROWS(R, CALL)                                                                   \
    switch (R) {                                                                            \
    ROW_CASES_1_TO_6(CALL)                                                                  \
    case 7: CALL(MR >= 7 ? 7 : MR); break;                                                  \
    default: CALL(MR >= 8 ? 8 : MR); break;                                                 \
    }

/* The same for R = 1..MR_PACKED (micro-kernels reading x packed k-major). */
#define FOR_PACKED_ROWS(R, CALL)                                                            \
    switch (R) {                                                                            \
    ROW_CASES_1_TO_6(CALL)                                                                  \
    case 7: CALL(7); break;                                                                 \
    case 8: CALL(8); break;                                                                 \
    case 9: CALL(MR_PACKED >= 9 ? 9 : MR); break;                                           \
    case 10: CALL(MR_PACKED >= 10 ? 10 : MR); break;                                        \
    case 11: CALL(MR_PACKED >= 11 ? 11 : MR); break;                                        \
    default: CALL(MR_PACKED >= 12 ? 12 : MR); break;                                        \
    }

typedef struct {
    const void *x;
    int64_t x_stride;
    const void *packed;
    int wdt, xdt;
    const float *bias;
    void *y; /* fp32 while the products are summed in it; see ydt */
    int64_t y_stride, m, n, k;
    int ydt; /* y's dtype: fp32, or bf16/fp16 (each item summed in fp32 scratch, rounded once) */
    uint16_t *xtiles; /* AMX: x packed in tile order, block by block (cpu_gemm_amx.h), or NULL */
    uint32_t *xstate; /* per x block: whether xtiles holds it yet */
    const float *xpack; /* fp32 x of the block being computed, packed by pack_x_block, or NULL */
    int64_t x_row0; /* the row of x that x points at (a block widened into scratch), else 0 */
} Gemm;

#if defined(__AMX_BF16__)
#include "cpu_gemm_amx.h"
#define AMX_TILES 1
#else
#define AMX_TILES 0
#endif

/* 1 when a bf16 GEMM of depth k runs on AMX tiles here (an AMX build, k a multiple of 32, AMX
 * granted to the process), else 0: bf16 products then take VDPBF16PS or widening. */
int kvflow_gemm_amx(int64_t k) {
#if AMX_TILES
    const Gemm g = {.wdt = DT_BF16, .xdt = DT_BF16, .k = k};
    return amx_applies(&g);
#else
    (void)k;
    return 0;
#endif
}

/* cpuid leaf 1's eax of a CPU whose vendor string (leaf 0: ebx, edx, ecx) is ebx edx ecx,
 * else 0 (another vendor, or no cpuid). */
static unsigned cpuid_signature(unsigned ebx, unsigned edx, unsigned ecx) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != ebx || d != edx || c != ecx) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return a;
#else
    (void)ebx, (void)edx, (void)ecx;
    return 0;
#endif
}

/* 1 on an AMD CPU of family 26 (0x1A, Zen 5) or later, else 0 (cpuid leaves 0 and 1; family =
 * base family + extended family, AMD's CPUID specification). Zen 5 cores execute two 512-bit
 * VDPBF16PS or FMA a cycle; Zen 4 splits each into two 256-bit halves. */
static int amd_zen5_or_later(void) {
    const unsigned a = cpuid_signature(0x68747541u, 0x69746e65u, 0x444d4163u); /* AuthenticAMD */
    unsigned family = (a >> 8) & 0xf;
    if (family == 0xf) family += (a >> 20) & 0xff;
    return family >= 0x1a;
}

/* 1 on an Intel Ice Lake server core (family 6, model 106 or 108: Xeon 3rd generation, two
 * 512-bit FMA pipes, no AVX512-BF16), else 0 (cpuid leaves 0 and 1). */
static int intel_icelake_server(void) {
    const unsigned a = cpuid_signature(0x756e6547u, 0x49656e69u, 0x6c65746eu); /* GenuineIntel */
    const unsigned family = (a >> 8) & 0xf, model = ((a >> 4) & 0xf) | (((a >> 16) & 0xf) << 4);
    return family == 6 && (model == 106 || model == 108);
}

/* 1 when blocks of more than MR rows of fp32 x are packed k-major (pack_x_block) and run
 * micro-kernels of up to MR_PACKED rows, else 0 (x read in place). On Ice Lake server cores
 * (AVX512 builds) packing pays: the in-place micro-kernel needs a general register per row
 * stream (8 rows spill them) and its 6-row tile issues 8 loads per 12 FMAs; packed, 12 rows
 * read one stream at constant offsets, 14 loads per 24 FMAs, which two FMA pipes keep busy.
 * Measured there (docs/benchmarks.md, session 51); other CPUs keep the layout they were
 * measured with. cpuid runs once per process. */
int kvflow_gemm_x_packed(void) {
    static int packed; /* 0 until detected, then 1 (yes) or 2 (no) */
    int r = __atomic_load_n(&packed, __ATOMIC_RELAXED);
    if (!r) {
        r = MR_PACKED > MR && intel_icelake_server() ? 1 : 2;
        __atomic_store_n(&packed, r, __ATOMIC_RELAXED);
    }
    return r == 1;
}

/* Rows per micro-kernel of k-paired bf16 weights (VDPBF16PS) in the blocks of more than
 * MR_BALANCED rows (compute-bound: 64-row decode steps, prefill tails): MR on Zen 5 and later
 * AMD cores in AVX512-BF16 builds, MR_FULL elsewhere. Measured on a Zen 5 EPYC (one thread,
 * weights streamed, SmolLM2-135M's decode shapes at 64 rows): 8 rows 1.04-1.14x faster than 6
 * (the 16 accumulators of 8 rows cover VDPBF16PS's latency at two a cycle; 6 rows' 12 do not
 * quite), while fp32 weights ran 0.94-0.98x with 8 (they keep MR_FULL); on Zen 4 8-row
 * micro-kernels were 1.06x slower at 64 rows (docs/benchmarks.md, session 22), so other CPUs
 * keep 6. cpuid runs once per process (it traps to the hypervisor in a VM). */
int kvflow_gemm_full_rows(void) {
    static int rows; /* 0 until detected; every thread computes the same value */
    int r = __atomic_load_n(&rows, __ATOMIC_RELAXED);
    if (!r) {
        r = BF16_PAIRS && MR > MR_FULL && amd_zen5_or_later() ? MR : MR_FULL;
        __atomic_store_n(&rows, r, __ATOMIC_RELAXED);
    }
    return r;
}

/* Rows per micro-kernel in a block of mb rows (full: kvflow_gemm_full_rows()). Up to MR rows:
 * all of them, so the weight chunk is read once, streamed from memory by the hardware
 * prefetcher with the products computed as it arrives. Up to MR_BALANCED rows (AVX512): equal
 * shares of at most MR rows. Beyond that (compute-bound: the chunk is re-read from L1 many
 * times) `full` rows (MR_FULL, which ran faster there on Zen 4; MR for k-paired bf16 on
 * Zen 5). Measured on a
 * Zen 4 EPYC (AVX512-BF16) on SmolLM2-135M's decode shapes, weights streamed from memory,
 * 2 threads, against 6-row micro-kernels that all prefetch: k-paired
 * bf16 1.09-1.26x faster at 1-8 rows, 1.13x at 16, level at 12 and 24-64; fp32 1.14-1.35x at
 * 1-16 rows; at 64 rows 8-row micro-kernels were 1.06x slower than 6-row ones
 * (docs/benchmarks.md, session 22). */
static inline int64_t kernel_rows(int64_t mb, int64_t full) {
    if (mb <= MR) return mb;
    if (full > MR) { /* x packed: equal shares of at most `full` (MR_PACKED) rows */
        const int64_t passes = (mb + full - 1) / full;
        return (mb + passes - 1) / passes;
    }
    if (mb > MR_BALANCED) return full;
    const int64_t passes = (mb + MR - 1) / MR;
    return (mb + passes - 1) / passes;
}

/* Rows [ic, ic + mb) of x times panel p into y, KC values of k at a time; the panel is read
 * once, front to back. Blocks of several micro-kernels prefetch the next KC x NR chunk, each
 * micro-kernel its share. In AVX512 builds a block of fewer than MR rows (one micro-kernel)
 * leaves the stream to the hardware prefetcher when its weight is fp32 or k-paired bf16
 * (measured on Zen 4: 1.1-1.2x faster than with prefetches into L1), and prefetches for a widened 16-bit weight (1.08x faster with it at 4-6
 * rows). From MR to MR_BALANCED rows of fp32 or k-paired bf16 the next chunk is prefetched into
 * L2, not L1: the current chunk (16-32 KB), which every micro-kernel of the block re-reads, and
 * the block's x fill L1 (32 KB on Zen 4), so a next chunk prefetched into L1 evicted it. On
 * Zen 4, streamed decode shapes, 2 threads: bf16 1.1x at 8 rows, 1.22-1.31x at 9-12, 1.08-1.12x
 * at 16-20, 1.03-1.05x at 28-32; fp32 1.13x at 8, 1.15-1.5x at 9-24; the same into L2 at 64-96
 * rows (MR_FULL micro-kernels) ran 0.98-0.99x, for widened weights 0.97-0.99x, and for a lone
 * micro-kernel of 1-5 rows 0.83-0.88x (docs/benchmarks.md, session 23). Edge panels (fewer
 * than NR columns) go through an MR x NR scratch tile. */
static inline __attribute__((always_inline)) void block_panel(const Gemm *g, int64_t ic,
                                                               int64_t mb, int64_t p, int wdt,
                                                               int paired, float *y,
                                                               int64_t ldy) {
    const int64_t cols = min64(g->n - p * NR, NR), es = (int64_t)elem_size(wdt);
    const int64_t kk_n = paired ? (g->k + 1) / 2 * 2 : g->k, xes = paired ? 2 : 4;
    const char *panel = (const char *)g->packed + p * kk_n * NR * es;
    float tile[MR_MAX * NR], bias_tile[NR];
    const float *bias = NULL;
    if (g->bias) {
        for (int64_t j = 0; j < NR; ++j) bias_tile[j] = j < cols ? g->bias[p * NR + j] : 0.f;
        bias = bias_tile;
    }
    const int xpacked = g->xpack != NULL;
    const int64_t full = xpacked ? MR_PACKED : paired ? kvflow_gemm_full_rows() : MR_FULL;
    const int64_t mr = kernel_rows(mb, full), kernels = (mb + mr - 1) / mr;
    const int widened = wdt != DT_F32 && !paired; /* more work per weight byte */
    const int pf_l2 = !xpacked && !widened && mb >= MR && mb <= MR_BALANCED;
    const int64_t pf_lines = kernels > 1 || PF_ONE_PASS || widened || pf_l2
                                 ? (KC * NR * es / 64 + kernels - 1) / kernels : 0;
    for (int64_t pc = 0; pc < g->k; pc += KC) {
        const int64_t kc = min64(g->k - pc, KC);
        const char *wp = panel + pc * NR * es, *next = wp + kc * NR * es;
        const float *init = pc == 0 ? bias : NULL;
        for (int64_t ir = 0; ir < mb; ir += mr) {
            const int64_t rows = min64(mb - ir, mr);
            const char *xm = xpacked ? (const char *)(g->xpack + ir * g->k + pc * rows)
                                     : (const char *)g->x
                                           + ((ic - g->x_row0 + ir) * g->x_stride + pc) * xes;
            const char *pf = next + ir / mr * pf_lines * 64;
            const int direct = cols == NR;
            float *c = direct ? y + ir * ldy : tile;
            const int64_t ldc = direct ? ldy : NR;
            const int acc = direct && pc > 0;
#if BF16_PAIRS
            if (paired) {
#define DP(R) micro_kernel_dp(R, kc, (const uint16_t *)xm, g->x_stride, (const uint16_t *)wp, \
                              c, ldc, acc, init, pf, pf_lines, pf_l2)
                FOR_ROWS(rows, DP)
#undef DP
            } else
#endif
            {
#define MK(R) micro_kernel(R, kc, (const float *)xm, g->x_stride, wp, wdt, c, ldc, acc, init, \
                           pf, pf_lines, pf_l2, 0)
#define MKP(R) micro_kernel(R, kc, (const float *)xm, 0, wp, wdt, c, ldc, acc, init, pf, \
                            pf_lines, pf_l2, 1)
                if (xpacked) FOR_PACKED_ROWS(rows, MKP)
                else FOR_ROWS(rows, MK)
#undef MKP
#undef MK
            }
            if (!direct)
                for (int64_t i = 0; i < rows; ++i)
                    for (int64_t j = 0; j < cols; ++j) {
                        float *out = y + (ir + i) * ldy + j;
                        *out = (pc > 0 ? *out : 0.f) + tile[i * NR + j];
                    }
        }
    }
}

/* Rows [ic, ic + mb) of x times panel p into y (row stride ldy; column 0 = the panel's first):
 * one specialized loop nest per weight layout. */
static void block_times_panel_to(const Gemm *g, int64_t ic, int64_t mb, int64_t p, float *y,
                                 int64_t ldy) {
    if (g->k == 0) { /* an empty product is the bias (or zero) */
        const int64_t cols = min64(g->n - p * NR, NR);
        for (int64_t i = 0; i < mb; ++i)
            for (int64_t j = 0; j < cols; ++j)
                y[i * ldy + j] = g->bias ? g->bias[p * NR + j] : 0.f;
        return;
    }
#if AMX_TILES
    if (amx_applies(g)) amx_block_panel(g, ic, mb, p, y, ldy, DT_F32);
    else
#endif
    if (g->wdt == DT_BF16 && BF16_PAIRS) block_panel(g, ic, mb, p, DT_BF16, 1, y, ldy);
    else if (g->wdt == DT_BF16) block_panel(g, ic, mb, p, DT_BF16, 0, y, ldy);
    else if (g->wdt == DT_F16) block_panel(g, ic, mb, p, DT_F16, 0, y, ldy);
    else block_panel(g, ic, mb, p, DT_F32, 0, y, ldy);
}

/* Rows [ic, ic + mb) of x times panel p, in place in y: summed there (fp32 y), or in an
 * fp32 scratch tile (in L1) rounded into a 16-bit y row by row. */
static void block_times_panel(const Gemm *g, int64_t ic, int64_t mb, int64_t p) {
#if AMX_TILES
    if (g->k > 0 && amx_applies(g)) { /* rounds a 16-bit y itself, per 32-row group */
        const int64_t es = (int64_t)elem_size(g->ydt);
        amx_block_panel(g, ic, mb, p, (char *)g->y + (ic * g->y_stride + p * NR) * es,
                        g->y_stride, g->ydt);
        return;
    }
#endif
    if (g->ydt == DT_F32) {
        block_times_panel_to(g, ic, mb, p, (float *)g->y + ic * g->y_stride + p * NR,
                             g->y_stride);
        return;
    }
    float tile[MC * NR];
    block_times_panel_to(g, ic, mb, p, tile, NR);
    const int64_t cols = min64(g->n - p * NR, NR), es = (int64_t)elem_size(g->ydt);
    for (int64_t i = 0; i < mb; ++i)
        store_row(g->ydt, tile + i * NR, (char *)g->y + ((ic + i) * g->y_stride + p * NR) * es,
                  cols);
}

/* Rows of x per block: up to 96 rows of all of k, within ~256 KB (half this EPYC's L2); on AMX
 * tiles AMX_MB (cpu_gemm_amx.h: the k-chunked loop keeps x's block in L2 however long k is). */
static int64_t block_rows(const Gemm *g) {
#if AMX_TILES
    if (g->k > 0 && amx_applies(g)) return AMX_MB;
#endif
    const int64_t full = g->wdt == DT_BF16 && BF16_PAIRS ? kvflow_gemm_full_rows() : MR_FULL;
    const int64_t k = g->k, rows = (65536 / (k > 0 ? k : 1)) / full * full;
    return rows < full ? full : rows > MC ? MC : rows;
}

/* Rows [ic, ic + mb) of x (fp32, or bf16 widened exactly on the way) packed into fp32 xp for
 * packed micro-kernels: chunk by chunk of kernel_rows(mb, MR_PACKED) rows, the chunk starting
 * at row ir (R rows) at xp + ir * k laid out [k][R], so a micro-kernel broadcasts its R values
 * of one k from consecutive floats. */
static void pack_x_block(const Gemm *g, int64_t ic, int64_t mb, float *xp) {
    const int64_t mr = kernel_rows(mb, MR_PACKED), k = g->k;
    for (int64_t ir = 0; ir < mb; ir += mr) {
        const int64_t rows = min64(mb - ir, mr);
        float *dst = xp + ir * k;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = ic + ir + r;
            if (g->xdt == DT_BF16) {
                const uint16_t *src = (const uint16_t *)g->x + row * g->x_stride;
                for (int64_t kk = 0; kk < k; ++kk) {
                    const uint32_t u = (uint32_t)src[kk] << 16; /* bf16: fp32's top half */
                    memcpy(dst + kk * rows + r, &u, sizeof u);
                }
            } else {
                const float *src = (const float *)g->x + row * g->x_stride;
                for (int64_t kk = 0; kk < k; ++kk) dst[kk * rows + r] = src[kk];
            }
        }
    }
}

/* gt (a thread's copy of g) reading rows [ic, ic + mb) of x from the thread's scratch xp where
 * they are packed (pack: pack_x_block) or widened from bf16 (widen: row-major, rows of k);
 * else from x in place. */
static void block_x(const Gemm *g, Gemm *gt, int64_t ic, int64_t mb, float *xp, int pack,
                    int widen, int64_t *xp_block, int *xp_packed) {
    *gt = *g;
    if (!pack && !widen) return;
    if (*xp_block != ic || *xp_packed != pack) {
        if (pack) pack_x_block(g, ic, mb, xp);
        else widen_x((const uint16_t *)g->x + ic * g->x_stride, g->x_stride, xp, g->k, mb);
        *xp_block = ic, *xp_packed = pack;
    }
    if (pack) {
        gt->xpack = xp;
    } else {
        gt->x = xp, gt->x_stride = g->k, gt->xdt = DT_F32, gt->x_row0 = ic;
    }
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

/* x [m, k] (dtype xdt = kvflow_gemm_x_dtype(wdt), row stride x_stride) @ a packed weight of
 * dtype wdt (kvflow_gemm_pack of [n, k]) + bias [n] fp32 (or NULL) -> y [m, n] of dtype ydt
 * (row stride y_stride): the fp32 sums, or (bf16/fp16) them rounded once to nearest even.
 * Returns 1 when x has the wrong dtype, the work does not fit the item counter (more than 2^32
 * items) or scratch cannot be allocated, else 0. */
int kvflow_gemm(const void *x, int64_t x_stride, int xdt, const void *packed, int wdt,
                const float *bias, void *y, int64_t y_stride, int ydt, int64_t m, int64_t n,
                int64_t k, int num_threads) {
    if (xdt != kvflow_gemm_x_dtype(wdt)) return 1;
    if (m <= 0 || n <= 0) return 0;
    Gemm g = {x, x_stride, packed, wdt, xdt, bias, y, y_stride, m, n, k, ydt, NULL, NULL, NULL, 0};
    const int64_t panels = (n + NR - 1) / NR, mb_max = block_rows(&g);
    const int64_t blocks = (m + mb_max - 1) / mb_max;
    const int nt = num_threads < 1 ? 1 : (int64_t)num_threads > panels ? (int)panels : num_threads;
    if (blocks * panels >= ((int64_t)1 << 32)) return 1;
    /* fp32 x (bf16 x widened on the way) packed per thread, block by block, where
     * kvflow_gemm_x_packed: blocks of more than MR rows for 16-bit weights widened in
     * registers (1.13x at 16 rows), of more than MR_BALANCED for fp32 weights (at 16 rows
     * the in-place 8-row micro-kernels, their next chunk prefetched into L2, ran 0.85-1.0x
     * against packed ones; docs/benchmarks.md, session 51). A thread repacks when it moves to
     * another block. */
    const int64_t pack_above = wdt == DT_F32 ? MR_BALANCED : MR;
    const int widen = widens_x(xdt) && k > 0;
    const int xpack = (xdt == DT_F32 || widen) && k > 0 && m > pack_above
                      && kvflow_gemm_x_packed();
    /* bf16 x of widened panels: up to X_STACK values (a decode row or a few) widened here, on
     * the stack. More: where x is packed, by each thread as it packs a block (blocks it does
     * not pack, row-major into the same scratch: block_x), rather than all of x into an m x k
     * scratch first, whose writing and re-reading cost 2,048-row products 1.0-1.1x their time
     * on an Ice Lake Xeon; elsewhere all of x into scratch, here or past X_TEAM values by the
     * team before the products (a barrier more, which a decode-sized x does not pay for):
     * block by block ran 0.92-0.99x on the AVX2 build (docs/benchmarks.md, session 52). */
    enum { X_STACK = 4096, X_TEAM = 1 << 16 };
    float x_stack[X_STACK], *x32 = NULL;
    const int widen_here = widen && m * k <= X_STACK, widen_blocks = widen && !widen_here && xpack;
    const int x_heap = widen && !widen_here && !xpack, widen_team = x_heap && m * k > X_TEAM;
    if (widen_here || x_heap) {
        x32 = x_heap ? aligned_alloc(64, (size_t)((m * k + 15) / 16 * 16) * sizeof(float))
                     : x_stack;
        if (!x32) return 1;
        if (!widen_team) widen_x(x, x_stride, x32, k, m);
        g.x = x32, g.x_stride = k, g.xdt = DT_F32;
    }
    const size_t scratch = (size_t)((mb_max * k * 4 + 63) / 64 * 64);
    char *xps = xpack ? aligned_alloc(64, scratch * (size_t)nt) : NULL;
    Share *shares = aligned_alloc(64, sizeof(Share) * nt);
    if (!shares || (xpack && !xps)) {
        free(shares), free(xps);
        if (x_heap) free(x32);
        return 1;
    }
#if AMX_TILES
    if (m >= AMX_PACK_ROWS && panels > 1 && k > 0 && amx_applies(&g)) {
        /* whole 16-row strips; without memory, x is read in place */
        g.xtiles = aligned_alloc(64, (size_t)((m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * k * 2));
        g.xstate = calloc((size_t)blocks, sizeof *g.xstate);
        if (!g.xtiles || !g.xstate) {
            free(g.xtiles), free(g.xstate);
            g.xtiles = NULL, g.xstate = NULL;
        }
    }
#endif
    /* Thread t's share: panels [p0, p1) for every x block, item = block * (p1 - p0) + p - p0. */
    for (int t = 0; t < nt; ++t)
        shares[t].range = (uint64_t)(blocks * (panels * (t + 1) / nt - panels * t / nt));
#pragma omp parallel num_threads(nt)
    {
        const int self = omp_get_thread_num();
        if (widen_team) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; ++i)
                widen_x((const uint16_t *)x + i * x_stride, x_stride, x32 + i * k, k, 1);
        }
        Gemm gt = g;
        float *xp = xps ? (float *)(xps + scratch * (size_t)self) : NULL;
        int64_t xp_block = -1;
        int xp_packed = 0;
        for (int i = 0; i < nt; ++i) {
            const int t = (self + i) % nt; /* own share first, then the others' */
            const int64_t p0 = panels * t / nt, width = panels * (t + 1) / nt - p0;
            for (int64_t item; (item = claim(&shares[t], t != self)) >= 0;) {
                const int64_t ic = item / width * mb_max, mb = min64(m - ic, mb_max);
#if AMX_TILES
                amx_pack_block_once(&g, item / width, ic, mb);
#endif
                if (xpack) /* else gt is g throughout */
                    block_x(&g, &gt, ic, mb, xp, mb > pack_above, widen_blocks, &xp_block,
                            &xp_packed);
                block_times_panel(&gt, ic, mb, p0 + item % width);
            }
        }
    }
    free(shares);
    free(xps);
    if (x_heap) free(x32);
    free(g.xtiles);
    free(g.xstate);
    return 0;
}

/* The GEMM as a job of kvflow's pool (cpu_pool.h): item = (x block, weight panel), block-major;
 * a worker computes its item into an mb x NR scratch tile, committed into y. */
typedef struct {
    Gemm g;
    int64_t mb_max, panels;
} PooledGemm;

static int pooled_item(const void *ctx, int64_t item, float *scratch) {
    const PooledGemm *pg = ctx;
    const int64_t ic = item / pg->panels * pg->mb_max, p = item % pg->panels;
    const int64_t mb = min64(pg->g.m - ic, pg->mb_max);
    if (scratch) block_times_panel_to(&pg->g, ic, mb, p, scratch, NR);
    else block_times_panel(&pg->g, ic, mb, p);
    return 0;
}

static void pooled_commit(const void *ctx, int64_t item, const float *scratch) {
    const PooledGemm *pg = ctx;
    const int64_t ic = item / pg->panels * pg->mb_max, p = item % pg->panels;
    const int64_t mb = min64(pg->g.m - ic, pg->mb_max), cols = min64(pg->g.n - p * NR, NR);
    const int64_t es = (int64_t)elem_size(pg->g.ydt);
    for (int64_t i = 0; i < mb; ++i)
        store_row(pg->g.ydt, scratch + i * NR,
                  (char *)pg->g.y + ((ic + i) * pg->g.y_stride + p * NR) * es, cols);
}

/* kvflow_gemm on a pool (cpu_pool.h) instead of OpenMP threads: x and bias are copied into the
 * pool's buffers first (a late worker may read them after this returns); the packed weight
 * must outlive the pool's use of it. Falls back to kvflow_gemm with num_threads when the pool
 * is NULL, busy with another thread's job or out of memory. Same results as kvflow_gemm. */
int kvflow_gemm_pooled(KvflowPool *pool, const void *x, int64_t x_stride, int xdt,
                       const void *packed, int wdt, const float *bias, void *y, int64_t y_stride,
                       int ydt, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (xdt != kvflow_gemm_x_dtype(wdt)) return 1;
    if (m <= 0 || n <= 0) return 0;
    if (!kvflow_pool_begin(pool))
        return kvflow_gemm(x, x_stride, xdt, packed, wdt, bias, y, y_stride, ydt, m, n, k,
                           num_threads);
    const int widen = widens_x(xdt); /* the pool's copy of x is then fp32 */
    const size_t xes = elem_size(xdt), row = (size_t)k * xes;
    const size_t row_c = widen ? (size_t)k * sizeof(float) : row;
    char *xc = kvflow_pool_buffer(pool, 0, (size_t)m * row_c + 64);
    float *bc = bias ? kvflow_pool_buffer(pool, 1, (size_t)n * sizeof(float)) : NULL;
    if (!xc || (bias && !bc)) {
        kvflow_pool_end(pool);
        return kvflow_gemm(x, x_stride, xdt, packed, wdt, bias, y, y_stride, ydt, m, n, k,
                           num_threads);
    }
    if (widen) widen_x(x, x_stride, (float *)xc, k, m);
    else
        for (int64_t i = 0; i < m; ++i)
            memcpy(xc + i * row, (const char *)x + i * x_stride * xes, row);
    if (bias) memcpy(bc, bias, (size_t)n * sizeof(float));
    const Gemm g = {xc, k, packed, wdt, widen ? DT_F32 : xdt, bc, y, y_stride, m, n, k, ydt,
                    NULL, NULL, NULL, 0};
    const int64_t panels = (n + NR - 1) / NR, mb_max = block_rows(&g);
    const PooledGemm pg = {g, mb_max, panels};
    kvflow_pool_run(pool, pooled_item, pooled_commit, &pg, sizeof pg, mb_max * NR,
                    (m + mb_max - 1) / mb_max * panels);
    kvflow_pool_end(pool);
    return 0;
}
