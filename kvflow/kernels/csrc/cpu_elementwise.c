/*
 * Fused row-wise ops for kvflow's CPU path, each one pass over memory instead of the 4-10 torch
 * ops (and temporaries) of the plain version. Rounding follows the torch code they replace, so
 * 16-bit results match it: fp32 math, rounded to the storage dtype wherever torch rounds.
 *
 *   kvflow_rms_norm:      [residual = x + residual;] y = w * round(r * rsqrt(mean(r^2) + eps))
 *                         (Zhang & Sennrich 2019, HF LlamaRMSNorm ordering)
 *   kvflow_silu_and_mul:  y = round(silu(gate)) * up for x = [gate | up] (SwiGLU, Shazeer 2020)
 *   kvflow_rotary:        q, k rotated in place by RoPE (Su et al. 2021), neox or gpt-j pairs
 *
 * Rows are split over OpenMP threads (torch's libgomp runtime, see cpu_attention.c); a small
 * pass (a decode step's) runs on the calling thread alone (threads_for, cpu_common.h).
 */
#include "cpu_common.h"
#include "cpu_entry_points.h"
#include "cpu_elementwise_avx512.h"

/* Call f(DT, args...) with the dtype a compile-time constant, so an always-inline row function
 * specializes per dtype. */
#define BY_DTYPE(dtype, f, ...)                              \
    do {                                                     \
        if ((dtype) == DT_BF16) f(DT_BF16, __VA_ARGS__);     \
        else if ((dtype) == DT_F16) f(DT_F16, __VA_ARGS__);  \
        else f(DT_F32, __VA_ARGS__);                         \
    } while (0)

/* Round fp32 values to the storage dtype and back (identity for fp32). */
static inline void round_to(int dtype, float *x, int64_t n, float *tmp16) {
    if (dtype == DT_F32) return;
    store_row(dtype, x, tmp16, n);
    load_row(dtype, tmp16, x, n);
}

/* x, out (and residual when not NULL): [rows, hidden] with row strides in elements; weight
 * [hidden]. With residual: residual_out = x + residual, normalised. Returns 1 when scratch
 * memory cannot be allocated. */
int kvflow_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                    void *residual_out, const void *weight, void *out, int64_t rows,
                    int64_t hidden, float eps, int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    int failed = 0;
#pragma omp parallel num_threads(threads_for(rows * hidden, num_threads)) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * hidden * 3), *w = buf + hidden, *tmp = w + hidden;
        if (buf) load_row(dtype, weight, w, hidden);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
            if (!buf) continue;
#if HAVE_EW512
            BY_DTYPE(dtype, ew_rms_row, (const char *)x + i * x_stride * es,
                     residual ? (const char *)residual + i * r_stride * es : NULL,
                     residual ? (char *)residual_out + i * hidden * es : NULL,
                     (const char *)weight,
                     (char *)out + i * hidden * es, hidden, eps);
            continue;
#endif
            load_row(dtype, (const char *)x + i * x_stride * es, buf, hidden);
            if (residual) {
                load_row(dtype, (const char *)residual + i * r_stride * es, tmp, hidden);
                for (int64_t d = 0; d < hidden; ++d) buf[d] += tmp[d];
                store_row(dtype, buf, (char *)residual_out + i * hidden * es, hidden);
                round_to(dtype, buf, hidden, tmp);
            }
            float ss = 0.f;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < hidden; ++d) ss += buf[d] * buf[d];
            const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
            for (int64_t d = 0; d < hidden; ++d) buf[d] *= inv;
            round_to(dtype, buf, hidden, tmp);
            for (int64_t d = 0; d < hidden; ++d) buf[d] *= w[d];
            store_row(dtype, buf, (char *)out + i * hidden * es, hidden);
        }
        failed |= !buf;
        free(buf);
    }
    return failed;
}

/* silu(v) = v / (1 + exp(-v)) = v * exp(v) / (1 + exp(v)), through e = exp(-|v|) <= 1 only
 * (no overflow) and without branches, so loops over it vectorize. */
static inline float silu(float v) {
    const float e = exp_nonpos(-fabsf(v));
    return v * (v >= 0.f ? 1.f : e) / (1.f + e);
}

/* Embedding lookup: rows ids [m] (int64) of table [n, k] (elements of elem_bytes bytes, row
 * stride table_stride elements) -> out [m, k] contiguous. One thread (a row is a memcpy).
 * Returns 2 when an id lies outside [0, n) (rows before it are written), else 0. */
int kvflow_embedding_rows(const void *table, int64_t table_stride, int64_t n, int64_t k,
                          int64_t elem_bytes, const int64_t *ids, int64_t m, void *out) {
    for (int64_t t = 0; t < m; ++t) {
        if (ids[t] < 0 || ids[t] >= n) return 2;
        memcpy((char *)out + t * k * elem_bytes,
               (const char *)table + ids[t] * table_stride * elem_bytes, (size_t)(k * elem_bytes));
    }
    return 0;
}

/* x: [rows, 2 * inter] (row stride x_stride), out: [rows, inter] contiguous. */
int kvflow_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter,
                        int dtype, int num_threads) {
    const size_t es = elem_size(dtype);
    int failed = 0;
#pragma omp parallel num_threads(threads_for(rows * inter * 2, num_threads)) \
    reduction(| : failed)
    {
        float *gate = malloc(sizeof(float) * inter * 3), *up = gate + inter, *tmp = up + inter;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
            if (!gate) continue;
            const char *row = (const char *)x + i * x_stride * es;
#if HAVE_EW512
            BY_DTYPE(dtype, ew_silu_row, row, (char *)out + i * inter * es, inter);
            continue;
#endif
            load_row(dtype, row, gate, inter);
            load_row(dtype, row + inter * es, up, inter);
#pragma omp simd
            for (int64_t d = 0; d < inter; ++d) gate[d] = silu(gate[d]);
            round_to(dtype, gate, inter, tmp);
            for (int64_t d = 0; d < inter; ++d) gate[d] *= up[d];
            store_row(dtype, gate, (char *)out + i * inter * es, inter);
        }
        failed |= !gate;
        free(gate);
    }
    return failed;
}

/* Rotate the first rot_dim dims of each of n heads at x (head stride head_dim) by the angles
 * whose cos/sin are cs[0 : rot_dim/2] / cs[rot_dim/2 : rot_dim]. */
static void rotate_heads(int dtype, char *x, int64_t n, int64_t head_dim, int64_t rot_dim,
                         const float *cs, int neox, float *buf) {
    const size_t es = elem_size(dtype);
    const int64_t half = rot_dim / 2;
    const float *cos = cs, *sin = cs + half;
    for (int64_t h = 0; h < n; ++h) {
        char *head = x + h * head_dim * es;
        load_row(dtype, head, buf, rot_dim);
        float *o = buf + rot_dim;
        for (int64_t j = 0; j < half; ++j) {
            const int64_t i1 = neox ? j : 2 * j, i2 = neox ? j + half : 2 * j + 1;
            const float x1 = buf[i1], x2 = buf[i2];
            o[i1] = x1 * cos[j] - x2 * sin[j];
            o[i2] = x2 * cos[j] + x1 * sin[j];
        }
        store_row(dtype, o, head, rot_dim);
    }
}

/* q: [tokens, num_heads, head_dim] (token stride q_stride), k: [tokens, num_kv_heads,
 * head_dim] (token stride k_stride), both rotated in place; positions int64 [tokens];
 * cos_sin fp32 [max_position, rot_dim] (cos half then sin half). Returns 2 (nothing rotated)
 * when a position lies outside [0, max_position), 1 when scratch memory cannot be allocated. */
int kvflow_rotary(const int64_t *positions, void *q, int64_t q_stride, int64_t num_heads,
                  void *k, int64_t k_stride, int64_t num_kv_heads, int64_t head_dim,
                  int64_t rot_dim, const float *cos_sin, int64_t max_position, int64_t tokens,
                  int neox, int dtype, int num_threads) {
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return 2;
    const size_t es = elem_size(dtype);
    int failed = 0;
#pragma omp parallel num_threads(threads_for(tokens * (num_heads + num_kv_heads) * rot_dim, \
                                             num_threads)) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * rot_dim * 2);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) {
            if (!buf) continue;
            const float *cs = cos_sin + positions[t] * rot_dim;
#if HAVE_EW512
            if (neox) {
                BY_DTYPE(dtype, ew_rotary_neox, (char *)q + t * q_stride * es, num_heads,
                         head_dim, rot_dim, cs);
                BY_DTYPE(dtype, ew_rotary_neox, (char *)k + t * k_stride * es, num_kv_heads,
                         head_dim, rot_dim, cs);
                continue;
            }
#endif
            rotate_heads(dtype, (char *)q + t * q_stride * es, num_heads, head_dim, rot_dim, cs,
                         neox, buf);
            rotate_heads(dtype, (char *)k + t * k_stride * es, num_kv_heads, head_dim, rot_dim,
                         cs, neox, buf);
        }
        failed |= !buf;
        free(buf);
    }
    return failed;
}

/* s[0:n] (fp32, in place) = cap * tanh(s / cap), the attention kernels' soft cap
 * (soft_cap_scores in cpu_common.h) as its own entry point, so tests can hold each build's tanh
 * against a float64 oracle; cap <= 0 leaves s unchanged. Returns 0. */
int kvflow_soft_cap(float *s, int64_t n, float cap) {
    soft_cap_scores(s, n, cap);
    return 0;
}
