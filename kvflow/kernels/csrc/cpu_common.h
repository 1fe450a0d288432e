/* Helpers shared by kvflow's native CPU kernels: storage-dtype conversion of fp32 rows, an
 * 8-lane fp32 vector type and a vectorizable exp. All static inline: each kernel file includes
 * this header and the compiler specializes the code in place. */
#ifndef KVFLOW_CPU_COMMON_H
#define KVFLOW_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline size_t elem_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

/* Threads for a pass over `elements` values: one below 64K values (a decode step's rows), where
 * waking a second thread costs more than it saves and, beside a busy process, the region would
 * wait for a thread descheduled on the shared core; else num_threads. */
static inline int threads_for(int64_t elements, int num_threads) {
    return elements < ((int64_t)1 << 16) ? 1 : num_threads;
}

/* n elements of the storage dtype at src -> fp32 at dst. */
static inline void load_row(int dtype, const void *src, float *dst, int64_t n) {
    if (dtype == DT_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == DT_BF16) {
        const uint16_t *s = src;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            uint32_t u = (uint32_t)s[i] << 16;
            memcpy(dst + i, &u, 4);
        }
    } else {
        const _Float16 *s = src;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = (float)s[i];
    }
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* n fp32 values at src -> the storage dtype at dst. */
static inline void store_row(int dtype, const float *src, void *dst, int64_t n) {
    if (dtype == DT_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == DT_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else {
        _Float16 *d = dst;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) d[i] = (_Float16)src[i];
    }
}

/* Eight fp32 lanes (GCC/Clang vector extension: AVX on x86, two NEON registers on arm64). */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline float sum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

#ifdef __clang__
#define SHUFFLE4(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#else
#define SHUFFLE4(a, b, i, j, k, l) __builtin_shuffle(a, b, (v4i){i, j, k, l})
#endif

/* The lane sums of four vectors at once, {sum8(a0), sum8(a1), sum8(a2), sum8(a3)}: halves
 * added, then a 4 x 4 transpose-and-add (about a third of the instructions of four sum8). */
static inline v4f sum8x4(v8f a0, v8f a1, v8f a2, v8f a3) {
    const v4f b0 = (v4f){a0[0], a0[1], a0[2], a0[3]} + (v4f){a0[4], a0[5], a0[6], a0[7]};
    const v4f b1 = (v4f){a1[0], a1[1], a1[2], a1[3]} + (v4f){a1[4], a1[5], a1[6], a1[7]};
    const v4f b2 = (v4f){a2[0], a2[1], a2[2], a2[3]} + (v4f){a2[4], a2[5], a2[6], a2[7]};
    const v4f b3 = (v4f){a3[0], a3[1], a3[2], a3[3]} + (v4f){a3[4], a3[5], a3[6], a3[7]};
    const v4f c0 = SHUFFLE4(b0, b1, 0, 4, 1, 5) + SHUFFLE4(b0, b1, 2, 6, 3, 7);
    const v4f c1 = SHUFFLE4(b2, b3, 0, 4, 1, 5) + SHUFFLE4(b2, b3, 2, 6, 3, 7);
    return SHUFFLE4(c0, c1, 0, 1, 4, 5) + SHUFFLE4(c0, c1, 2, 3, 6, 7);
}

/* floor(y) for |y| < 2^31, written so loops over it vectorize at every ISA level: with SSE4.1
 * (and off x86) the compiler's floor (ROUNDPS, FRINTM); in the x86-64 baseline build (SSE2
 * only), where floorf has no vector form and kept every loop calling it scalar, y truncated
 * toward zero (CVTTPS2DQ) less 1 where that rounded up: the same value, exactly. */
static inline float floor_vec(float y) {
#if defined(__SSE2__) && !defined(__SSE4_1__)
    const float t = (float)(int32_t)y;
    return t > y ? t - 1.f : t;
#else
    return __builtin_floorf(y);
#endif
}

/* exp(x) for x <= 0 in fp32 (max rel. error ~2e-7), written so loops over it vectorize:
 * exp(x) = 2^n * exp(r) with n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2], exp(r) by
 * its degree-6 Taylor polynomial; inputs below -87 return 0 (masked keys arrive as -inf). */
static inline float exp_nonpos(float x) {
    const float xc = x < -87.f ? -87.f : x;
    const float n = floor_vec(xc * 1.44269504f + 0.5f);
    const float r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { int32_t i; float f; } scale = {((int32_t)n + 127) << 23};
    return x < -87.f ? 0.f : p * scale.f;
}

/* tanh(y) in fp32 without libm, written so loops over it vectorize (8 lanes in AVX2 builds, 16
 * with AVX-512): for |y| < 0.4 the odd Taylor series of tanh through y^13 (Abramowitz & Stegun
 * 4.5.64; the first omitted term, 929569/638512875 |y|^15, is below 1.7e-9 |y| there), else
 * (1 - e) / (1 + e) with e = exp(-2|y|) <= exp(-0.8) by exp_nonpos (relative error ~2e-7),
 * which 1 - e >= 0.55 amplifies at most 0.82x (1 + e: 0.31x); the sign restored by
 * copysign. Relative error at most ~1.13 x 2.6e-7 + 3 roundings, under 8 fp32 units (2^-24);
 * measured 4.4 units over 2^24 points in [-20, 20] (tests/kernels/test_softcap_cpu_attention.py
 * bounds it at every ISA level). |y| >= ~44 gives exactly +-1 (exp_nonpos returns 0 below -87). */
static inline float tanh_fast(float y) {
    const float a = __builtin_fabsf(y), a2 = a * a;
    float p = 21844.f / 6081075.f;
    p = p * a2 - 1382.f / 155925.f;
    p = p * a2 + 62.f / 2835.f;
    p = p * a2 - 17.f / 315.f;
    p = p * a2 + 2.f / 15.f;
    p = p * a2 - 1.f / 3.f;
    const float e = exp_nonpos(-2.f * a);
    const float t = a < 0.4f ? a + a * a2 * p : (1.f - e) / (1.f + e);
    return __builtin_copysignf(t, y);
}

/* Soft-capped attention scores (Gemma 2 report, Gemma Team 2024, sec. 2; attn_logit_softcapping):
 * s[t] = cap * tanh(s[t] / cap) for the n scores, each already q.k * softmax_scale; cap <= 0:
 * unchanged. Apply it before masking (tanh(-inf) would make a masked key visible). AVX2 and
 * AVX-512 builds take tanh_fast over vector lanes; the portable build keeps libm's tanhf. */
static inline void soft_cap_scores(float *s, int64_t n, float cap) {
    if (cap <= 0.f) return;
#if defined(__AVX2__)
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = cap * tanh_fast(s[t] / cap);
#else
    for (int64_t t = 0; t < n; ++t) s[t] = cap * tanhf(s[t] / cap);
#endif
}

#endif
