/* GEMM against llama.cpp GGML blocks kept in memory: out[m, n] = x[m, :] . W[n, :] (+ bias)
 * with W stored as the raw blocks of a GGUF tensor, dequantized inside the product.
 *
 * Work is split over tiles of TILE_ROWS weight rows. Each block of a weight row is dequantized
 * into vector registers, 16 values at a time, and multiplied at once against up to 8
 * activation rows, never stored: a weight row is dequantized once per 8 activation rows and
 * each quantized byte read from memory once per call (later passes over the same row find it
 * in cache). At batch 1 the product is bound by reading the weights, and the blocks are
 * 4.5-8.5 bits per weight instead of 32: that is the point of keeping them.
 *
 * Block layouts and formulas are ggml's (ggml-quants.c dequantize_row_*, structs in
 * ggml-common.h), the same as kernels/gguf_dequant.py (which documents them in a table);
 * gguf.quants.dequantize (numpy) is the oracle both are tested against.
 * Returns 0, or 2 for an unknown type. */
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu_common.h"

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q8_0 = 8, GGML_Q4_K = 12,
       GGML_Q5_K = 13, GGML_Q6_K = 14 };

#define TILE_ROWS 8


/* Quantized values come 16 at a time as bytes (v16u8: one SSE register on every x86); the
 * arithmetic on floats runs in the ISA's native vector width VW: 16 lanes (one register) in
 * AVX-512 builds, 8 otherwise. GCC 12 lowers 16-lane float vectors on AVX2 into element-wise
 * moves through the stack (a scalar broadcast became 16 stores), so 16 values are two 8-lane
 * halves there. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16s8 __attribute__((vector_size(16)));
typedef uint8_t vu8 __attribute__((vector_size(VW)));
typedef int8_t vs8 __attribute__((vector_size(VW)));

static inline v16u8 bytes16(const uint8_t *p) {
    v16u8 v;
    memcpy(&v, p, 16);
    return v;
}

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Bytes h * VW .. h * VW + VW - 1 of q as floats, sign-extended (is_signed: int8 quants) or
 * zero-extended through int32 lanes: one vpmovsxbd / vpmovzxbd and one conversion, written
 * with intrinsics (GCC 12 converts byte lanes straight to float, or to int32 on AVX2, one
 * lane at a time; on AVX-512 it lowers the signed int8 -> int32 vector conversion into 16
 * scalar sign extensions and inserts, which made Q8_0 3-5x slower than Q4_0 there). is_signed
 * is a constant wherever this is inlined. */
static inline vf bytes_to_f(v16u8 q, int h, int is_signed) {
#if defined(__AVX512F__)
    (void)h;
    __m128i x;
    memcpy(&x, &q, 16);
    const __m512i w = is_signed ? _mm512_cvtepi8_epi32(x) : _mm512_cvtepu8_epi32(x);
    vi wide;
    memcpy(&wide, &w, sizeof wide);
#elif defined(__AVX2__)
    __m128i x;
    memcpy(&x, &q, 16);
    if (h) x = _mm_unpackhi_epi64(x, x);
    const __m256i w = is_signed ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x);
    vi wide;
    memcpy(&wide, &w, sizeof wide);
#elif defined(__SSE2__)
    /* the x86-64 baseline: SSE2 has no byte-to-dword widening (GCC's generic conversion went
     * lane by lane through the stack, ~12x slower than AVX2), so bytes are interleaved with
     * themselves (signed: then shifted right arithmetically) or with zeros, 8 -> 16 -> 32 bits */
    __m128i x;
    memcpy(&x, &q, 16);
    if (h) x = _mm_unpackhi_epi64(x, x);
    const __m128i zero = _mm_setzero_si128();
    const __m128i w16 = is_signed ? _mm_srai_epi16(_mm_unpacklo_epi8(x, x), 8)
                                  : _mm_unpacklo_epi8(x, zero);
    const __m128i lo = is_signed ? _mm_srai_epi32(_mm_unpacklo_epi16(w16, w16), 16)
                                 : _mm_unpacklo_epi16(w16, zero);
    const __m128i hi = is_signed ? _mm_srai_epi32(_mm_unpackhi_epi16(w16, w16), 16)
                                 : _mm_unpackhi_epi16(w16, zero);
    const __m128i parts[2] = {lo, hi};
    vi wide;
    memcpy(&wide, parts, sizeof wide);
#else
    vu8 b;
    memcpy(&b, (const char *)&q + h * VW, VW);
    const vi wide = is_signed ? __builtin_convertvector((vs8)b, vi)
                              : __builtin_convertvector(b, vi);
#endif
    return __builtin_convertvector(wide, vf);
}

static inline float hsum(vf v) {
    float sum = 0.0f;
    for (int j = 0; j < VW; ++j) sum += v[j];
    return sum;
}

/* Where a block's values go, 16 at a time (values 16 j .. 16 j + 15 of the block): multiplied
 * against mb rows of x (x[i * xs + 16 j ..]) into the accumulators acc, or stored to
 * dst[16 j ..]. Inlined with a constant store flag and mb the tests fold away and the
 * accumulators are registers; each 16 values are used as soon as they are made, for every x
 * row, so a weight is dequantized once per mb rows and never stored (a Q4_K block whole would
 * be 16 vectors of 16 lanes, 32 AVX2 registers of the 16 there are). */
typedef struct {
    const float *x; /* with xs, mb and acc, when store is 0 */
    int64_t xs;
    int mb;
    vf *acc; /* [mb][acc_split(mb)] */
    float *dst; /* when store is 1 */
    int store;
} Sink;

enum { MB_MAX = 8 }; /* x rows per pass: 8 accumulators, 8 independent FMA chains */

/* Accumulators per x row: one per VW-lane part of the 16 values where mb x parts fit in
 * MB_MAX registers (independent FMA chains for few rows), else one. */
static inline int acc_split(int mb) { return mb * (16 / VW) <= MB_MAX ? 16 / VW : 1; }

static inline void emit_f(Sink s, int j, int h, vf v) {
    if (s.store) {
        memcpy(s.dst + 16 * j + h * VW, &v, sizeof v);
        return;
    }
    const int split = acc_split(s.mb);
    for (int i = 0; i < s.mb; ++i)
        s.acc[i * split + (split > 1 ? h : 0)] += v * loadv(s.x + i * s.xs + 16 * j + h * VW);
}

#if defined(__SSE2__) && !defined(__AVX2__)
#define SSE2_ONLY 1
/* d in every lane, from two SSE registers (GCC 12 splats a scalar into an 8-lane vector of
 * the SSE2 build by eight 4-byte stores and a 16-byte reload, which stalls store forwarding). */
static inline vf splat(float d) {
    const __m128 h = _mm_set1_ps(d), parts[2] = {h, h};
    vf v;
    memcpy(&v, parts, sizeof v);
    return v;
}
#else
#define SSE2_ONLY 0
#endif

static inline void emit_q(Sink s, int j, v16u8 q, int is_signed, float d, float m) {
#if SSE2_ONLY
    const vf dv = splat(d), mv = splat(m); /* lane for lane the same products and sums */
#else
    const float dv = d, mv = m;
#endif
    for (int h = 0; h < 16 / VW; ++h) emit_f(s, j, h, dv * bytes_to_f(q, h, is_signed) + mv);
}

static inline void emit(Sink s, int j, v16u8 q, float d, float m) { emit_q(s, j, q, 0, d, m); }

static inline float f16_at(const uint8_t *p) {
#if SSE2_ONLY
    /* the baseline has no F16C: GCC calls libgcc's __extendhfsf2 once a block; the exact
     * widening by IEEE 754's fields instead (subnormal halves m 2^-24, exact in fp32) */
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t bits = sign | (e == 31 ? 0x7F800000u | m << 13 : (e + 112) << 23 | m << 13);
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
#else
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
#endif
}

/* Each blk_* dequantizes one block into out (see Sink); inlined into the loops below. */
static inline void blk_q4_0(const uint8_t *b, Sink out) { /* 18 bytes -> 32: d (q - 8) */
    const float d = f16_at(b);
    const v16u8 q = bytes16(b + 2);
    emit(out, 0, q & 0xF, d, -8.0f * d);
    emit(out, 1, q >> 4, d, -8.0f * d);
}

static inline void blk_q4_1(const uint8_t *b, Sink out) { /* 20 bytes -> 32: d q + m */
    const float d = f16_at(b), m = f16_at(b + 2);
    const v16u8 q = bytes16(b + 4);
    emit(out, 0, q & 0xF, d, m);
    emit(out, 1, q >> 4, d, m);
}

/* 16 if bit `bit` of h's byte is set, else 0, per byte (a fifth quant bit, already shifted
 * into place: a compare instead of byte shifts, which x86 lacks). */
static inline v16u8 bit_as_16(v16u8 h, uint8_t bit) {
    return (v16u8)((h & (uint8_t)(1u << bit)) != 0) & 16;
}

/* The Q5_0 fifth bits of 16 quants, 16 or 0 per byte: byte i of the result tests bit i % 8 of
 * byte 2 h + i / 8 of qh (h = 0 for the low nibbles, 1 for the high ones). On AVX2 one byte
 * shuffle spreads the two bytes; elsewhere two broadcasts and a blend. */
static inline v16u8 fifth_bits(uint32_t qh, int h) {
    const v16u8 mask = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    v16u8 spread;
#if defined(__AVX2__)
    const __m128i idx = h ? _mm_set_epi64x(0x0303030303030303, 0x0202020202020202)
                          : _mm_set_epi64x(0x0101010101010101, 0);
    const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)qh), idx);
    memcpy(&spread, &b, 16);
#else
    const uint8_t lo_byte = (qh >> (16 * h)) & 0xFF, hi_byte = (qh >> (16 * h + 8)) & 0xFF;
    const v16u8 low_half = {255, 255, 255, 255, 255, 255, 255, 255};
    spread = (((v16u8){} + lo_byte) & low_half) | (((v16u8){} + hi_byte) & ~low_half);
#endif
    return (v16u8)((spread & mask) != 0) & 16;
}

static inline void blk_q5_0(const uint8_t *b, Sink out) { /* 22 bytes -> 32: d (q - 16) */
    const float d = f16_at(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const v16u8 q = bytes16(b + 6);
    emit(out, 0, (q & 0xF) | fifth_bits(qh, 0), d, -16.0f * d);
    emit(out, 1, (q >> 4) | fifth_bits(qh, 1), d, -16.0f * d);
}

static inline void blk_q8_0(const uint8_t *b, Sink out) { /* 34 bytes -> 32: d q */
    const float d = f16_at(b);
    emit_q(out, 0, bytes16(b + 2), 1, d, 0.0f); /* int8 quants */
    emit_q(out, 1, bytes16(b + 18), 1, d, 0.0f);
}

/* The j-th (scale, min) 6-bit pair of a K-quant super-block (ggml get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline void blk_q4_k(const uint8_t *b, Sink out) { /* 144 bytes -> 256 */
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int c = 0; c < 4; ++c, q += 32) {
        int sc, m;
        scale_min_k4(2 * c, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(2 * c + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 2; ++l) {
            const v16u8 x = bytes16(q + 16 * l);
            emit(out, 4 * c + l, x & 0xF, d1, -m1);
            emit(out, 4 * c + l + 2, x >> 4, d2, -m2);
        }
    }
}

static inline void blk_q5_k(const uint8_t *b, Sink out) { /* 176 bytes -> 256 */
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 48;
    for (int c = 0; c < 4; ++c, q += 32) {
        int sc, m;
        scale_min_k4(2 * c, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(2 * c + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 2; ++l) {
            const v16u8 x = bytes16(q + 16 * l), h = bytes16(qh + 16 * l);
            emit(out, 4 * c + l, (x & 0xF) | bit_as_16(h, 2 * c), d1, -m1);
            emit(out, 4 * c + l + 2, (x >> 4) | bit_as_16(h, 2 * c + 1), d2, -m2);
        }
    }
}

static inline void blk_q6_k(const uint8_t *b, Sink out) { /* 210 bytes -> 256: s (q - 32) */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_at(b + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 2; ++l) { /* positions 16l..16l+15 of each 32; scale index l */
            const v16u8 a = bytes16(ql + 16 * l), c = bytes16(ql + 32 + 16 * l);
            const v16u8 h = bytes16(qh + 16 * l);
            const int j = 8 * half + l;
            const float s0 = d * sc[l], s2 = d * sc[l + 2], s4 = d * sc[l + 4],
                        s6 = d * sc[l + 6];
            emit(out, j, (a & 0xF) | ((h & 3) << 4), s0, -32.0f * s0);
            emit(out, j + 2, (c & 0xF) | (((h >> 2) & 3) << 4), s2, -32.0f * s2);
            emit(out, j + 4, (a >> 4) | (((h >> 4) & 3) << 4), s4, -32.0f * s4);
            emit(out, j + 6, (c >> 4) | (((h >> 6) & 3) << 4), s6, -32.0f * s6);
        }
    }
}

/* Per block type: dot_* multiplies one weight row by MB x rows (each block dequantized once,
 * into registers, and used for every row; MB a constant where it is inlined); tile_* runs it
 * for rows [n0, n0 + rows) of W and every x row, in passes of 8, 4, 2 and 1 x rows; row_*
 * dequantizes one row (the reference path). */
#define GGUF_KERNELS(BLK, ELEMS, NBYTES)                                                      \
    static inline void dot_##BLK(int mb, const float *x, int64_t xs, const uint8_t *src,      \
                                 int64_t k, float *out, int64_t os, float bias) {             \
        vf acc[MB_MAX] = {};                                                                  \
        for (int64_t e = 0; e < k; e += ELEMS, src += NBYTES)                                 \
            BLK(src, (Sink){x + e, xs, mb, acc, NULL, 0});                                    \
        const int split = acc_split(mb);                                                      \
        for (int i = 0; i < mb; ++i) {                                                        \
            vf sum = acc[i * split];                                                          \
            for (int h = 1; h < split; ++h) sum += acc[i * split + h];                        \
            out[i * os] = hsum(sum) + bias;                                                   \
        }                                                                                     \
    }                                                                                         \
    static void tile_##BLK(const float *x, int64_t x_stride, const uint8_t *w,                \
                           int64_t row_bytes, int64_t n0, int rows, int64_t m, int64_t k,     \
                           float *out, int64_t out_stride, const float *bias) {               \
        for (int r = 0; r < rows; ++r) {                                                      \
            const uint8_t *src = w + (n0 + r) * row_bytes;                                    \
            const float b = bias ? bias[n0 + r] : 0.0f;                                       \
            for (int64_t i = 0; i < m;) {                                                     \
                const float *xi = x + i * x_stride;                                           \
                float *o = out + i * out_stride + n0 + r;                                     \
                const int64_t left = m - i;                                                   \
                const int mb = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;             \
                if (mb == 8) dot_##BLK(8, xi, x_stride, src, k, o, out_stride, b);            \
                else if (mb == 4) dot_##BLK(4, xi, x_stride, src, k, o, out_stride, b);       \
                else if (mb == 2) dot_##BLK(2, xi, x_stride, src, k, o, out_stride, b);       \
                else dot_##BLK(1, xi, x_stride, src, k, o, out_stride, b);                    \
                i += mb;                                                                      \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    static void row_##BLK(const uint8_t *src, int64_t k, float *dst) {                        \
        for (int64_t e = 0; e < k; e += ELEMS, src += NBYTES)                                 \
            BLK(src, (Sink){NULL, 0, 0, NULL, dst + e, 1});                                   \
    }

GGUF_KERNELS(blk_q4_0, 32, 18)
GGUF_KERNELS(blk_q4_1, 32, 20)
GGUF_KERNELS(blk_q5_0, 32, 22)
GGUF_KERNELS(blk_q8_0, 32, 34)
GGUF_KERNELS(blk_q4_k, 256, 144)
GGUF_KERNELS(blk_q5_k, 256, 176)
GGUF_KERNELS(blk_q6_k, 256, 210)

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, int64_t, int64_t, int, int64_t,
                        int64_t, float *, int64_t, const float *);
typedef void (*row_fn)(const uint8_t *, int64_t, float *);

/* The kernels of a GGML type; 0 for an unknown type. */
static int kernels_for(int type, tile_fn *tile, row_fn *row) {
    switch (type) {
    case GGML_Q4_0: *tile = tile_blk_q4_0; *row = row_blk_q4_0; return 1;
    case GGML_Q4_1: *tile = tile_blk_q4_1; *row = row_blk_q4_1; return 1;
    case GGML_Q5_0: *tile = tile_blk_q5_0; *row = row_blk_q5_0; return 1;
    case GGML_Q8_0: *tile = tile_blk_q8_0; *row = row_blk_q8_0; return 1;
    case GGML_Q4_K: *tile = tile_blk_q4_k; *row = row_blk_q4_k; return 1;
    case GGML_Q5_K: *tile = tile_blk_q5_k; *row = row_blk_q5_k; return 1;
    case GGML_Q6_K: *tile = tile_blk_q6_k; *row = row_blk_q6_k; return 1;
    default: return 0;
    }
}

/* W [n, k] as fp32 (out [n, k]); 2 for an unknown type. */
int kvflow_gguf_dequantize(const uint8_t *w, int64_t row_bytes, int type, int64_t n, int64_t k,
                           float *out, int threads) {
    tile_fn tile;
    row_fn row;
    if (!kernels_for(type, &tile, &row)) return 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; ++r) row(w + r * row_bytes, k, out + r * k);
    return 0;
}

/* out[i, :n] = x[i, :k] . W.T (+ bias) for i < m; 2 for an unknown type. */
int kvflow_gguf_gemm(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                     int type, const float *bias, float *out, int64_t out_stride, int64_t m,
                     int64_t n, int64_t k, int threads) {
    tile_fn tile;
    row_fn row;
    if (!kernels_for(type, &tile, &row)) return 2;
    const int64_t tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * TILE_ROWS;
        const int rows = (int)(n - n0 < TILE_ROWS ? n - n0 : TILE_ROWS);
        tile(x, x_stride, w, row_bytes, n0, rows, m, k, out, out_stride, bias);
    }
    return 0;
}
