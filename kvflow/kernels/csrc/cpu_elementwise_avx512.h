/*
 * AVX512 rows of cpu_elementwise.c's kernels: 16 fp32 lanes per step, the storage dtype
 * widened and rounded in registers (bf16: a shift in, round-to-nearest-even by integer adds
 * out, as torch rounds, NaN kept quiet; fp16: VCVTPH2PS / VCVTPS2PH, nearest even), masked
 * loads and stores for a row's tail. The portable row loops of cpu_elementwise.c go through
 * scratch rows instead (load_row, store_row, round_to: three passes over L1 per rounding).
 * The math is the same operations in the same order per element, except SiLU (its exp by the
 * same polynomial as exp_nonpos's with fused multiply-adds, its division a reciprocal refined
 * by one Newton step: see ew_silu) and the sum of squares of RMSNorm (16 or 32 partial sums).
 * bf16 rows go 32 elements at a time as two 16-lane halves (bp_*).
 */
#ifndef KVFLOW_CPU_ELEMENTWISE_AVX512_H
#define KVFLOW_CPU_ELEMENTWISE_AVX512_H

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define HAVE_EW512 1

/* n (<= 16) elements of dtype at p, widened to fp32 (lanes past n: 0). */
static inline __attribute__((always_inline)) __m512 ew_load(int dtype, const void *p, int n) {
    const __mmask16 m = (__mmask16)((1u << n) - 1u);
    if (dtype == DT_F32) return _mm512_maskz_loadu_ps(m, p);
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (dtype == DT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The bf16 bit patterns (in the low half of each lane) of f rounded to nearest even; NaN
 * stays a quiet NaN (the same bits as f32_to_bf16 in cpu_common.h). */
static inline __m512i ew_bf16_bits(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
}

/* f rounded to dtype and widened back (identity for fp32). */
static inline __attribute__((always_inline)) __m512 ew_round(int dtype, __m512 f) {
    if (dtype == DT_F32) return f;
    if (dtype == DT_F16)
        return _mm512_cvtph_ps(_mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm512_castsi512_ps(_mm512_slli_epi32(ew_bf16_bits(f), 16));
}

/* The first n (<= 16) lanes of f, rounded to dtype, to p. */
static inline __attribute__((always_inline)) void ew_store(int dtype, void *p, __m512 f,
                                                           int n) {
    const __mmask16 m = (__mmask16)((1u << n) - 1u);
    if (dtype == DT_F32) {
        _mm512_mask_storeu_ps(p, m, f);
        return;
    }
    const __m256i h = dtype == DT_F16
        ? _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
        : _mm512_cvtepi32_epi16(ew_bf16_bits(f));
    _mm256_mask_storeu_epi16(p, m, h);
}

/* silu(v) = v / (1 + exp(-v)) on 16 lanes: exp(-v) = 2^m exp(r) with m = round(-v / ln 2),
 * r = -v - m ln 2 (|r| <= ln2 / 2), exp(r) by exp_nonpos's degree-6 Taylor polynomial (here in
 * r' = -r, coefficients of alternating sign), 2^m by VSCALEFPS (0 for large v: silu = v); the
 * division as a reciprocal estimate (VRCP14PS) refined by one Newton step (relative error
 * <= 2^-23). v is clamped at -87 inside exp only (e^87 keeps 1 + e and its reciprocal finite),
 * so below -87 silu is v / (1 + e^87) (|.| < 1e-35) where exact math gives v e^v. */
static inline __m512 ew_silu(__m512 v) {
    const __m512 vc = _mm512_max_ps(v, _mm512_set1_ps(-87.f));
    const __m512 m = _mm512_roundscale_ps(_mm512_mul_ps(vc, _mm512_set1_ps(-1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(m, _mm512_set1_ps(1.42860677e-6f),
                                     _mm512_fmadd_ps(m, _mm512_set1_ps(0.693145752f), vc));
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_scalef_ps(p, m));
    __m512 inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
    return _mm512_mul_ps(v, inv);
}

/* bf16 rows, 32 elements per 64-byte load: the even elements of a load widen by a shift, the
 * odd ones by clearing the low half of each 32-bit lane (no shuffle); a row op that works
 * element by element runs on the two halves and packs them back the same way. */
static inline __attribute__((always_inline)) void bp_load(const void *p, int n, __m512 *even,
                                                          __m512 *odd) {
    const __mmask32 m = n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1u);
    const __m512i x = _mm512_maskz_loadu_epi16(m, p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* f plus the round-to-nearest-even bias of bf16: the upper halves are f rounded to bf16.
 * A NaN stays NaN when its low half is zero, as every NaN these kernels compute is (payloads
 * of bf16 inputs, and the default NaN), so the NaN test of f32_to_bf16 is left out. */
static inline __m512i bp_biased(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

/* f rounded to bf16 (as fp32). */
static inline __m512 bp_round(__m512 f) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(bp_biased(f), _mm512_set1_epi32((int)0xffff0000u)));
}

/* The first n (<= 32) elements of the pair (even, odd), rounded to bf16, to p. */
static inline __attribute__((always_inline)) void bp_store(void *p, __m512 even, __m512 odd,
                                                           int n) {
    const __mmask32 m = n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1u);
    const __m512i e = _mm512_srli_epi32(bp_biased(even), 16);
    /* (odd & 0xffff0000) | e */
    const __m512i x = _mm512_ternarylogic_epi32(bp_biased(odd),
                                                _mm512_set1_epi32((int)0xffff0000u), e, 0xea);
    _mm512_mask_storeu_epi16(p, m, x);
}

/* bf16 SiLU-and-mul of one row (see ew_silu_row). */
static inline void bp_silu_row(const char *row, char *out, int64_t inter) {
    for (int64_t d = 0; d < inter; d += 32) {
        const int n = inter - d < 32 ? (int)(inter - d) : 32;
        __m512 ge, go, ue, uo;
        bp_load(row + 2 * d, n, &ge, &go);
        bp_load(row + 2 * (inter + d), n, &ue, &uo);
        bp_store(out + 2 * d, _mm512_mul_ps(bp_round(ew_silu(ge)), ue),
                 _mm512_mul_ps(bp_round(ew_silu(go)), uo), n);
    }
}

/* bf16 RMSNorm of one row (see ew_rms_row). */
static inline void bp_rms_row(const char *x, const char *res, char *res_out, const char *w,
                              char *out, int64_t hidden, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t d = 0; d < hidden; d += 32) {
        const int n = hidden - d < 32 ? (int)(hidden - d) : 32;
        __m512 e, o;
        bp_load(x + 2 * d, n, &e, &o);
        if (res) {
            __m512 re, ro;
            bp_load(res + 2 * d, n, &re, &ro);
            e = _mm512_add_ps(e, re);
            o = _mm512_add_ps(o, ro);
            bp_store(res_out + 2 * d, e, o, n);
            e = bp_round(e);
            o = bp_round(o);
        }
        ss = _mm512_fmadd_ps(e, e, _mm512_fmadd_ps(o, o, ss));
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hidden + eps));
    const char *src = res ? res_out : x;
    for (int64_t d = 0; d < hidden; d += 32) {
        const int n = hidden - d < 32 ? (int)(hidden - d) : 32;
        __m512 e, o, we, wo;
        bp_load(src + 2 * d, n, &e, &o);
        bp_load(w + 2 * d, n, &we, &wo);
        bp_store(out + 2 * d, _mm512_mul_ps(bp_round(_mm512_mul_ps(e, inv)), we),
                 _mm512_mul_ps(bp_round(_mm512_mul_ps(o, inv)), wo), n);
    }
}

/* out[0:inter] = round(silu(gate)) * up, rounded (gate = row[0:inter], up = row[inter:]). */
static inline __attribute__((always_inline)) void ew_silu_row(int dtype, const char *row,
                                                              char *out, int64_t inter) {
    if (dtype == DT_BF16) {
        bp_silu_row(row, out, inter);
        return;
    }
    const size_t es = elem_size(dtype);
    for (int64_t d = 0; d < inter; d += 16) {
        const int n = inter - d < 16 ? (int)(inter - d) : 16;
        const __m512 g = ew_round(dtype, ew_silu(ew_load(dtype, row + d * es, n)));
        const __m512 u = ew_load(dtype, row + (inter + d) * es, n);
        ew_store(dtype, out + d * es, _mm512_mul_ps(g, u), n);
    }
}

/* One row of kvflow_rms_norm: [res_out = x + res;] out = w * round(r * rsqrt(mean(r^2) + eps)). */
static inline __attribute__((always_inline)) void ew_rms_row(int dtype, const char *x,
                                                             const char *res, char *res_out,
                                                             const char *w, char *out,
                                                             int64_t hidden, float eps) {
    if (dtype == DT_BF16) {
        bp_rms_row(x, res, res_out, w, out, hidden, eps);
        return;
    }
    const size_t es = elem_size(dtype);
    __m512 ss = _mm512_setzero_ps();
    for (int64_t d = 0; d < hidden; d += 16) {
        const int n = hidden - d < 16 ? (int)(hidden - d) : 16;
        __m512 v = ew_load(dtype, x + d * es, n);
        if (res) {
            v = _mm512_add_ps(v, ew_load(dtype, res + d * es, n));
            ew_store(dtype, res_out + d * es, v, n);
            v = ew_round(dtype, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hidden + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    const char *src = res ? res_out : x;
    for (int64_t d = 0; d < hidden; d += 16) {
        const int n = hidden - d < 16 ? (int)(hidden - d) : 16;
        const __m512 y = ew_round(dtype, _mm512_mul_ps(ew_load(dtype, src + d * es, n), vinv));
        ew_store(dtype, out + d * es, _mm512_mul_ps(y, ew_load(dtype, w + d * es, n)), n);
    }
}

/* Rotate the first rot_dim dims of n heads at x (head stride head_dim) by neox pairs
 * (j, j + rot_dim / 2), cos/sin at cs[0 : half] / cs[half : rot_dim]. */
static inline __attribute__((always_inline)) void ew_rotary_neox(int dtype, char *x, int64_t n,
                                                                 int64_t head_dim,
                                                                 int64_t rot_dim,
                                                                 const float *cs) {
    const size_t es = elem_size(dtype);
    const int64_t half = rot_dim / 2;
    for (int64_t h = 0; h < n; ++h) {
        char *head = x + h * head_dim * es;
        for (int64_t j = 0; j < half; j += 16) {
            const int m = half - j < 16 ? (int)(half - j) : 16;
            const __m512 x1 = ew_load(dtype, head + j * es, m);
            const __m512 x2 = ew_load(dtype, head + (half + j) * es, m);
            const __m512 c = ew_load(DT_F32, cs + j, m), s = ew_load(DT_F32, cs + half + j, m);
            ew_store(dtype, head + j * es, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)), m);
            ew_store(dtype, head + (half + j) * es,
                     _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)), m);
        }
    }
}

#else
#define HAVE_EW512 0
#endif

#endif
