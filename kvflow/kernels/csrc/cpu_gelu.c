/*
 * GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415) for kvflow's CPU path, fp32 math for fp32,
 * bf16 and fp16 rows, so the CPU step graphs (kvflow/worker/cpu_graphs.py) can record the
 * activation of GELU and GeGLU MLPs instead of refusing a torch operator:
 *
 *   kvflow_gelu:          y = gelu(x)
 *   kvflow_gelu_and_mul:  y = round(gelu(gate)) * up for x = [gate | up] (GeGLU, Shazeer 2020,
 *                         "GLU Variants Improve Transformer"), torch's rounding points: gelu
 *                         rounded to the storage dtype, then the product rounded
 *
 * approximate = 1 is the tanh form (torch's approximate='tanh', HF gelu_pytorch_tanh):
 * 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), evaluated as the equal
 * x * sigmoid(2u) = x / (1 + exp(-2u)) through exp(-|2u|) <= 1 only, so 1 + tanh(u) never
 * cancels for negative x and nothing overflows. approximate = 0 is the exact (erf) form
 * 0.5 x erfc(-x / sqrt(2)), erfc(z) for z >= 0 by the Chebyshev fit of Numerical Recipes
 * (Press et al., 2nd ed., sec. 6.2, "erfcc": fractional error below 1.2e-7 everywhere) and
 * erfc(-z) = 2 - erfc(z).
 *
 * The portable row loops go through fp32 scratch rows (load_row, store_row) with loops the
 * compiler vectorizes at the library's ISA level; with AVX512 the rows are widened and rounded
 * in registers as in cpu_elementwise_avx512.h (same operations per element, fused
 * multiply-adds, the division of the tanh form as a Newton-refined reciprocal). Rows are split
 * over OpenMP threads; a decode step's small pass runs on the calling thread (threads_for).
 */
#include "cpu_common.h"
#include "cpu_entry_points.h"
#include "cpu_elementwise_avx512.h"

/* The kernels' approximate codes (kvflow/kernels/cpu_native_elementwise.py) */
enum { GELU_ERF = 0, GELU_TANH = 1 };

/* gelu(x) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3). */
static inline float gelu_tanh(float x) {
    const float v = 1.5957691216f * (x + 0.044715f * x * x * x);
    const float e = exp_nonpos(-fabsf(v));
    return x * (v >= 0.f ? 1.f : e) / (1.f + e);
}

/* erfc(z) for z >= 0: t exp(-z^2 + P(t)), t = 1 / (1 + z/2) (Numerical Recipes' erfcc). */
static inline float erfc_nonneg(float z) {
    const float t = 1.f / (1.f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    return t * exp_nonpos(p - z * z);
}

/* gelu(x) = x Phi(x) = 0.5 x erfc(-x / sqrt(2)). */
static inline float gelu_erf(float x) {
    const float c = erfc_nonneg(fabsf(x) * 0.70710678f);
    return 0.5f * x * (x >= 0.f ? 2.f - c : c);
}

/* n fp32 values in place: gelu of each. */
static __attribute__((unused)) void gelu_row(float *v, int64_t n, int approximate) {
    if (approximate == GELU_TANH) {
#pragma omp simd
        for (int64_t d = 0; d < n; ++d) v[d] = gelu_tanh(v[d]);
    } else {
#pragma omp simd
        for (int64_t d = 0; d < n; ++d) v[d] = gelu_erf(v[d]);
    }
}

#if HAVE_EW512
/* exp(a) on 16 lanes for a <= 0 (exp_nonpos's range reduction and degree-6 polynomial, fused
 * multiply-adds, 2^m by VSCALEFPS); a is clamped at -87 (exp(-87) ~ 1.6e-38). */
static inline __m512 gl_exp_nonpos(__m512 a) {
    const __m512 ac = _mm512_max_ps(a, _mm512_set1_ps(-87.f));
    const __m512 m = _mm512_roundscale_ps(_mm512_mul_ps(ac, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(m, _mm512_set1_ps(1.42860677e-6f),
                                      _mm512_fnmadd_ps(m, _mm512_set1_ps(0.693145752f), ac));
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, m);
}

/* gelu_tanh on 16 lanes; 1 / (1 + e) as VRCP14PS refined by one Newton step. */
static inline __m512 gl_tanh(__m512 x) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 v = _mm512_mul_ps(_mm512_fmadd_ps(x3, _mm512_set1_ps(0.044715f), x),
                                   _mm512_set1_ps(1.5957691216f));
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = gl_exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));
    const __m512 den = _mm512_add_ps(one, e);
    __m512 inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
    const __m512 num = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
    return _mm512_mul_ps(x, _mm512_mul_ps(num, inv));
}

/* gelu_erf on 16 lanes. */
static inline __m512 gl_erf(__m512 x) {
    const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678f));
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f),
                                   _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.f)));
    static const float coef[] = {-0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                                 -0.18628806f, 0.09678418f, 0.37409196f, 1.00002368f,
                                 -1.26551223f};
    __m512 p = _mm512_set1_ps(0.17087277f);
    for (int i = 0; i < 9; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(coef[i]));
    const __m512 c = _mm512_mul_ps(t, gl_exp_nonpos(_mm512_fnmadd_ps(z, z, p)));
    const __m512 phi2 = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), c,
        _mm512_sub_ps(_mm512_set1_ps(2.f), c));
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), phi2);
}

static inline __attribute__((always_inline)) __m512 gl_gelu(__m512 x, int approximate) {
    return approximate == GELU_TANH ? gl_tanh(x) : gl_erf(x);
}

/* One row: out[0:n] = gelu(x) (gated: round(gelu(x)) * x[n:2n], rounded). */
static inline __attribute__((always_inline)) void gl_row(int dtype, const char *x, char *out,
                                                         int64_t n, int gated,
                                                         int approximate) {
    if (dtype == DT_BF16) {
        for (int64_t d = 0; d < n; d += 32) {
            const int m = n - d < 32 ? (int)(n - d) : 32;
            __m512 e, o, ue = _mm512_set1_ps(1.f), uo = ue;
            bp_load(x + 2 * d, m, &e, &o);
            e = gl_gelu(e, approximate);
            o = gl_gelu(o, approximate);
            if (gated) {
                bp_load(x + 2 * (n + d), m, &ue, &uo);
                e = _mm512_mul_ps(bp_round(e), ue);
                o = _mm512_mul_ps(bp_round(o), uo);
            }
            bp_store(out + 2 * d, e, o, m);
        }
        return;
    }
    const size_t es = elem_size(dtype);
    for (int64_t d = 0; d < n; d += 16) {
        const int m = n - d < 16 ? (int)(n - d) : 16;
        __m512 g = gl_gelu(ew_load(dtype, x + d * es, m), approximate);
        if (gated) g = _mm512_mul_ps(ew_round(dtype, g), ew_load(dtype, x + (n + d) * es, m));
        ew_store(dtype, out + d * es, g, m);
    }
}

#define GL_BY_DTYPE(dtype, ...)                                  \
    do {                                                         \
        if ((dtype) == DT_BF16) gl_row(DT_BF16, __VA_ARGS__);    \
        else if ((dtype) == DT_F16) gl_row(DT_F16, __VA_ARGS__); \
        else gl_row(DT_F32, __VA_ARGS__);                        \
    } while (0)
#endif

/* The portable row: gelu through fp32 scratch (gate, up, tmp: n floats each). */
static __attribute__((unused)) void scratch_row(int dtype, const char *x, char *out, int64_t n, int gated,
                        int approximate, float *gate, float *up, float *tmp) {
    const size_t es = elem_size(dtype);
    load_row(dtype, x, gate, n);
    gelu_row(gate, n, approximate);
    if (gated) {
        if (dtype != DT_F32) { /* round gelu to the storage dtype, as torch does */
            store_row(dtype, gate, tmp, n);
            load_row(dtype, tmp, gate, n);
        }
        load_row(dtype, x + n * es, up, n);
        for (int64_t d = 0; d < n; ++d) gate[d] *= up[d];
    }
    store_row(dtype, gate, out, n);
}

/* x: [rows, (gated ? 2 : 1) * n] (row stride x_stride elements), out: [rows, n] contiguous. */
static int gelu_rows(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t n,
                     int gated, int approximate, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    int failed = 0;
#pragma omp parallel num_threads(threads_for(rows * n * (gated ? 2 : 1), num_threads)) \
    reduction(| : failed)
    {
        float *gate = HAVE_EW512 ? NULL : malloc(sizeof(float) * n * 3);
        failed |= !HAVE_EW512 && !gate;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
            const char *row = (const char *)x + i * x_stride * es;
            char *o = (char *)out + i * n * es;
#if HAVE_EW512
            GL_BY_DTYPE(dtype, row, o, n, gated, approximate);
#else
            if (gate) scratch_row(dtype, row, o, n, gated, approximate, gate, gate + n,
                                  gate + 2 * n);
#endif
        }
        free(gate);
    }
    return failed;
}

/* x, out: [rows, n] (x's row stride x_stride elements, out contiguous); approximate: 1 tanh,
 * 0 erf. Returns 1 when scratch memory cannot be allocated. */
int kvflow_gelu(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t n,
                int approximate, int dtype, int num_threads) {
    return gelu_rows(x, x_stride, out, rows, n, 0, approximate, dtype, num_threads);
}

/* x: [rows, 2 * inter] (row stride x_stride), out: [rows, inter] contiguous. */
int kvflow_gelu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows,
                        int64_t inter, int approximate, int dtype, int num_threads) {
    return gelu_rows(x, x_stride, out, rows, inter, 1, approximate, dtype, num_threads);
}
