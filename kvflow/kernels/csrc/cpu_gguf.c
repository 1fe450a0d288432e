/* GEMM against llama.cpp GGML blocks kept in memory: out[m, n] = x[m, :] . W[n, :] (+ bias)
 * with W stored as the raw blocks of a GGUF tensor, dequantized inside the product.
 *
 * Work is split over tiles of TILE_ROWS weight rows. With one activation row (decode) each
 * block is dequantized into 16-lane vector registers and multiplied at once, never stored;
 * with several, a thread dequantizes its tile once into a private fp32 buffer (TILE_ROWS x K
 * floats, in L1/L2) and multiplies every activation row against it. Either way each quantized
 * byte is read once per call. At batch 1 the product is bound by reading the weights, and the
 * blocks are 4.5-8.5 bits per weight instead of 32: that is the point of keeping them.
 *
 * Block layouts and formulas are ggml's (ggml-quants.c dequantize_row_*, structs in
 * ggml-common.h), the same as kernels/gguf_dequant.py (which documents them in a table);
 * gguf.quants.dequantize (numpy) is the oracle both are tested against.
 * Returns 0, 1 when a scratch buffer cannot be allocated, 2 for an unknown type. */
#include <omp.h>

#include "cpu_common.h"

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q8_0 = 8, GGML_Q4_K = 12,
       GGML_Q5_K = 13, GGML_Q6_K = 14 };

#define TILE_ROWS 8


static inline float f16_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* 16 lanes (GCC/Clang vector extensions: one AVX-512 register, or two AVX2 ones). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16s8 __attribute__((vector_size(16)));

static inline v16u8 bytes16(const uint8_t *p) {
    v16u8 v;
    memcpy(&v, p, 16);
    return v;
}

/* Bytes to floats through int32 lanes (zero-extend, then convert: two vector instructions;
 * GCC 12 converts uint8 lanes straight to float one lane at a time). */
static inline v16f to_f(v16u8 v) {
    return __builtin_convertvector(__builtin_convertvector(v, v16i), v16f);
}

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, 64);
    return v;
}

static inline float hsum(v16f v) {
    float sum = 0.0f;
    for (int j = 0; j < 16; ++j) sum += v[j];
    return sum;
}

/* a . b for k a multiple of 32 (every GGML block is 32 or 256 elements). */
static inline float dot(const float *a, const float *b, int64_t k) {
    v16f acc0 = {}, acc1 = {};
    for (int64_t i = 0; i < k; i += 32) {
        acc0 += load16(a + i) * load16(b + i);
        acc1 += load16(a + i + 16) * load16(b + i + 16);
    }
    return hsum(acc0 + acc1);
}

/* Each blk_* dequantizes one block into ELEMS / 16 vectors v[] (inlined into the loops below,
 * so the compiler keeps a small block in registers). */
static inline void blk_q4_0(const uint8_t *b, v16f *v) { /* 18 bytes -> 32 */
    const float d = f16_at(b);
    const v16u8 q = bytes16(b + 2);
    v[0] = (to_f(q & 0xF) - 8.0f) * d;
    v[1] = (to_f(q >> 4) - 8.0f) * d;
}

static inline void blk_q4_1(const uint8_t *b, v16f *v) { /* 20 bytes -> 32 */
    const float d = f16_at(b), m = f16_at(b + 2);
    const v16u8 q = bytes16(b + 4);
    v[0] = to_f(q & 0xF) * d + m;
    v[1] = to_f(q >> 4) * d + m;
}

static inline void blk_q5_0(const uint8_t *b, v16f *v) { /* 22 bytes -> 32 */
    const float d = f16_at(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16i high_lo = (((v16i){} + (int32_t)(qh & 0xFFFF)) >> lane) & 1;
    const v16i high_hi = (((v16i){} + (int32_t)(qh >> 16)) >> lane) & 1;
    const v16u8 q = bytes16(b + 6);
    const v16i lo = __builtin_convertvector(q & 0xF, v16i) | (high_lo << 4);
    const v16i hi = __builtin_convertvector(q >> 4, v16i) | (high_hi << 4);
    v[0] = __builtin_convertvector(lo - 16, v16f) * d;
    v[1] = __builtin_convertvector(hi - 16, v16f) * d;
}

static inline void blk_q8_0(const uint8_t *b, v16f *v) { /* 34 bytes -> 32 */
    const float d = f16_at(b);
    v16s8 q0, q1;
    memcpy(&q0, b + 2, 16);
    memcpy(&q1, b + 18, 16);
    v[0] = __builtin_convertvector(__builtin_convertvector(q0, v16i), v16f) * d;
    v[1] = __builtin_convertvector(__builtin_convertvector(q1, v16i), v16f) * d;
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

static inline void blk_q4_k(const uint8_t *b, v16f *v) { /* 144 bytes -> 256 */
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int c = 0; c < 4; ++c, q += 32, v += 4) {
        int sc, m;
        scale_min_k4(2 * c, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(2 * c + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 2; ++l) {
            const v16u8 x = bytes16(q + 16 * l);
            v[l] = d1 * to_f(x & 0xF) - m1;
            v[l + 2] = d2 * to_f(x >> 4) - m2;
        }
    }
}

static inline void blk_q5_k(const uint8_t *b, v16f *v) { /* 176 bytes -> 256 */
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 48;
    for (int c = 0; c < 4; ++c, q += 32, v += 4) {
        int sc, m;
        scale_min_k4(2 * c, scales, &sc, &m);
        const float d1 = d * sc, m1 = dmin * m;
        scale_min_k4(2 * c + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 2; ++l) {
            const v16u8 x = bytes16(q + 16 * l), h = bytes16(qh + 16 * l);
            v[l] = d1 * to_f((x & 0xF) + (((h >> (2 * c)) & 1) << 4)) - m1;
            v[l + 2] = d2 * to_f((x >> 4) + (((h >> (2 * c + 1)) & 1) << 4)) - m2;
        }
    }
}

static inline v16f q6_values(v16u8 low4, v16u8 high2, float scale) {
    const v16i q = __builtin_convertvector(low4 | (high2 << 4), v16i) - 32;
    return scale * __builtin_convertvector(q, v16f);
}

static inline void blk_q6_k(const uint8_t *b, v16f *v) { /* 210 bytes -> 256 */
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_at(b + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, v += 8) {
        for (int l = 0; l < 2; ++l) { /* positions 16l..16l+15 of each 32; scale index l */
            const v16u8 a = bytes16(ql + 16 * l), c = bytes16(ql + 32 + 16 * l);
            const v16u8 h = bytes16(qh + 16 * l);
            v[l] = q6_values(a & 0xF, h & 3, d * sc[l]);
            v[l + 2] = q6_values(c & 0xF, (h >> 2) & 3, d * sc[l + 2]);
            v[l + 4] = q6_values(a >> 4, (h >> 4) & 3, d * sc[l + 4]);
            v[l + 6] = q6_values(c >> 4, (h >> 6) & 3, d * sc[l + 6]);
        }
    }
}

/* Per block type: tile_* multiplies rows [n0, n0 + rows) of W by every x row (one x row:
 * each block dequantized into registers and used at once; several: the tile dequantized once
 * into buf [rows, k], then reused); rows_* dequantizes one row (the reference path). */
#define GGUF_KERNELS(BLK, ELEMS, NBYTES)                                                      \
    static void tile_##BLK(const float *x, int64_t x_stride, const uint8_t *w,                \
                           int64_t row_bytes, int64_t n0, int rows, int64_t m, int64_t k,     \
                           float *buf, float *out, int64_t out_stride, const float *bias) {   \
        for (int r = 0; r < rows; ++r) {                                                      \
            const uint8_t *src = w + (n0 + r) * row_bytes;                                    \
            v16f acc = {};                                                                    \
            for (int64_t e = 0; e < k; e += ELEMS, src += NBYTES) {                           \
                v16f v[ELEMS / 16];                                                           \
                BLK(src, v);                                                                  \
                if (m == 1)                                                                   \
                    for (int j = 0; j < ELEMS / 16; ++j) acc += v[j] * load16(x + e + 16 * j); \
                else                                                                          \
                    memcpy(buf + (int64_t)r * k + e, v, sizeof(v));                           \
            }                                                                                 \
            if (m == 1) out[n0 + r] = hsum(acc) + (bias ? bias[n0 + r] : 0.0f);               \
        }                                                                                     \
        for (int64_t i = 0; m > 1 && i < m; ++i)                                              \
            for (int r = 0; r < rows; ++r)                                                    \
                out[i * out_stride + n0 + r] = dot(x + i * x_stride, buf + (int64_t)r * k, k) \
                                               + (bias ? bias[n0 + r] : 0.0f);                \
    }                                                                                         \
    static void row_##BLK(const uint8_t *src, int64_t k, float *dst) {                        \
        for (int64_t e = 0; e < k; e += ELEMS, src += NBYTES) {                               \
            v16f v[ELEMS / 16];                                                               \
            BLK(src, v);                                                                      \
            memcpy(dst + e, v, sizeof(v));                                                    \
        }                                                                                     \
    }

GGUF_KERNELS(blk_q4_0, 32, 18)
GGUF_KERNELS(blk_q4_1, 32, 20)
GGUF_KERNELS(blk_q5_0, 32, 22)
GGUF_KERNELS(blk_q8_0, 32, 34)
GGUF_KERNELS(blk_q4_k, 256, 144)
GGUF_KERNELS(blk_q5_k, 256, 176)
GGUF_KERNELS(blk_q6_k, 256, 210)

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, int64_t, int64_t, int, int64_t,
                        int64_t, float *, float *, int64_t, const float *);
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

/* out[i, :n] = x[i, :k] . W.T (+ bias) for i < m; 1 when scratch cannot be allocated, 2 for an
 * unknown type. */
int kvflow_gguf_gemm(const float *x, int64_t x_stride, const uint8_t *w, int64_t row_bytes,
                     int type, const float *bias, float *out, int64_t out_stride, int64_t m,
                     int64_t n, int64_t k, int threads) {
    tile_fn tile;
    row_fn row;
    if (!kernels_for(type, &tile, &row)) return 2;
    const int64_t tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = m > 1 ? malloc(sizeof(float) * TILE_ROWS * (size_t)k) : NULL;
        if (m > 1 && buf == NULL) failed = 1;
#pragma omp for schedule(dynamic, 8)
        for (int64_t t = 0; t < tiles; ++t) {
            if (failed) continue;
            const int64_t n0 = t * TILE_ROWS;
            const int rows = (int)(n - n0 < TILE_ROWS ? n - n0 : TILE_ROWS);
            tile(x, x_stride, w, row_bytes, n0, rows, m, k, buf, out, out_stride, bias);
        }
        free(buf);
    }
    return failed;
}
