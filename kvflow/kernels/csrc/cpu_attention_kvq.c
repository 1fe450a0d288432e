/*
 * Paged attention on CPU over an 8-bit KV cache (--kv-cache-dtype int8 | fp8_e4m3): the
 * "cpu" attention backend's kernel for a quantized cache (cpu_attention.c reads 16/32-bit
 * caches).
 *
 * The cache holds each key/value row x (one token, one KV head) as 8-bit values q and one fp32
 * scale s with x ~= q * s (the rule is kvflow/kernels/kv_quant.py). Since s is constant over
 * the row, it comes out of both products:
 *   score(t)  = (q_query . qk[t]) * sk[t] * softmax_scale
 *   out       = sum_t p[t] * sv[t] * qv[t]
 * so each row is widened to fp32 once (int8: a conversion; e4m3: a 256-entry table) and every
 * query head of its GQA group reuses it.
 *
 * Layouts (row-major):
 *   q           [num_tokens, num_heads, head_dim]   (q's dtype: fp32/bf16/fp16; token stride
 *               q_stride, heads contiguous)
 *   k/v_cache   [num_blocks, block_size, num_kv_heads, head_dim]   1-byte elements
 *   k/v_scales  [num_blocks, block_size, num_kv_heads]            fp32
 *   out         [num_tokens, num_heads, head_dim]   (q's dtype, contiguous)
 *   block_table int32 [num_reqs, bt_stride]; query_start_loc int32 [num_reqs + 1];
 *   seq_lens    int32 [num_reqs], context length after this step.
 * Query token j of request r sits at position seq_lens[r] - query_len + j and sees the keys in
 * (pos - window, pos] (window <= 0: all of [0, pos]); query head i reads KV head
 * i / (num_heads / num_kv_heads).
 *
 * Work item = one query token with all its heads, in two passes over its visible keys (as
 * cpu_attention.c's decode path): scores of every head into a per-thread buffer, one softmax
 * over the whole context, then the value sums. Accumulation is fp32. Items run on the OpenMP
 * runtime torch has loaded. The caller guarantees the indices are in range.
 */
#include "cpu_common.h"

enum { KVQ_INT8 = 0, KVQ_FP8_E4M3 = 1 };

typedef struct {
    const char *q, *k_cache, *v_cache;
    const float *k_scales, *v_scales, *fp8_table;
    char *out;
    const int32_t *block_table, *query_start_loc, *seq_lens;
    int64_t q_stride, bt_stride, num_reqs, num_heads, num_kv_heads, head_dim, block_size, window;
    float scale, softcap; /* softcap > 0: scores soft-capped (soft_cap_scores) */
    int dtype, cache_kind;
} KvqArgs;

/* The value of every float8 e4m3fn bit pattern (OCP FP8: bias 7, no infinities, S.1111.111 is
 * NaN; subnormals m/8 * 2^-6). */
static void fp8_e4m3_table(float *table) {
    for (int b = 0; b < 256; ++b) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? (float)m / 8.f * 0x1p-6f : (1.f + (float)m / 8.f) * ldexpf(1.f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        table[b] = b & 128 ? -v : v;
    }
}

/* Row `row` (token slot * num_kv_heads + KV head) of a cache widened to fp32 (unscaled). */
static void widen_row(const KvqArgs *a, const char *cache, int64_t row, float *dst) {
    const int64_t D = a->head_dim;
    const uint8_t *src = (const uint8_t *)cache + row * D;
    if (a->cache_kind == KVQ_INT8) {
        const int8_t *s8 = (const int8_t *)src;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = (float)s8[d];
    } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = a->fp8_table[src[d]];
    }
}

static float dot_f32(const float *x, const float *y, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
    return s;
}

/* Request of flat query token `token` (query_start_loc rises). */
static int64_t request_of(const KvqArgs *a, int64_t token) {
    int64_t lo = 0, hi = a->num_reqs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (a->query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* One pass over the keys (pass 0: scores into p) or values (pass 1: sums into acc) of the
 * context [lo, pos] of request r, every KV head; q holds the scaled fp32 queries. */
static void kvq_pass(const KvqArgs *a, int pass, int64_t r, int64_t lo, int64_t pos,
                     const float *q, float *p, int64_t ld, float *acc, float *row) {
    const int64_t D = a->head_dim, Hkv = a->num_kv_heads, group = a->num_heads / Hkv;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    const char *cache = pass == 0 ? a->k_cache : a->v_cache;
    const float *scales = pass == 0 ? a->k_scales : a->v_scales;
    for (int64_t t = lo; t <= pos; ++t) {
        const int64_t slot = (int64_t)bt[t / a->block_size] * a->block_size + t % a->block_size;
        for (int64_t h = 0; h < Hkv; ++h) {
            widen_row(a, cache, slot * Hkv + h, row);
            const float s = scales[slot * Hkv + h];
            for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
                if (pass == 0) {
                    p[hq * ld + t - lo] = dot_f32(q + hq * D, row, D) * s;
                    continue;
                }
                const float w = p[hq * ld + t - lo] * s;
                float *o = acc + hq * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[d] += w * row[d];
            }
        }
    }
}

/* softmax numerators of p[0:n] in place; returns their sum. */
static float kvq_exp_shifted(float *p, int64_t n) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; ++t) mx = p[t] > mx ? p[t] : mx;
    for (int64_t t = 0; t < n; ++t) {
        p[t] = exp_nonpos(p[t] - mx);
        sum += p[t];
    }
    return sum;
}

/* Attention of flat query token `token`, all heads; scratch: q and acc [H * D], p [H * ld],
 * row [D]. */
static void kvq_attend(const KvqArgs *a, int64_t token, float *q, float *acc, float *p,
                       int64_t ld, float *row) {
    const int64_t D = a->head_dim, H = a->num_heads, HD = H * D;
    const size_t es = elem_size(a->dtype);
    const int64_t r = request_of(a, token);
    const int64_t qlen = a->query_start_loc[r + 1] - a->query_start_loc[r];
    const int64_t pos = a->seq_lens[r] - qlen + (token - a->query_start_loc[r]);
    const int64_t lo = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
    load_row(a->dtype, a->q + token * a->q_stride * es, q, HD);
    for (int64_t d = 0; d < HD; ++d) q[d] *= a->scale;
    kvq_pass(a, 0, r, lo, pos, q, p, ld, acc, row);
    float inv[H];
    for (int64_t hq = 0; hq < H; ++hq) {
        soft_cap_scores(p + hq * ld, pos + 1 - lo, a->softcap);
        inv[hq] = 1.f / kvq_exp_shifted(p + hq * ld, pos + 1 - lo);
    }
    memset(acc, 0, sizeof(float) * HD);
    kvq_pass(a, 1, r, lo, pos, q, p, ld, acc, row);
    for (int64_t i = 0; i < HD; ++i) acc[i] *= inv[i / D];
    store_row(a->dtype, acc, a->out + token * HD * es, HD);
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int kvflow_paged_attention_kvq(const void *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache, const float *k_scales,
                               const float *v_scales, void *out, const int32_t *block_table,
                               int64_t bt_stride, const int32_t *query_start_loc,
                               const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, int64_t window, float softcap, int dtype,
                               int cache_kind, int num_threads) {
    float fp8_table[256];
    fp8_e4m3_table(fp8_table);
    const KvqArgs a = {q, k_cache, v_cache, k_scales, v_scales, fp8_table, out, block_table,
                       query_start_loc, seq_lens, q_stride, bt_stride, num_reqs, num_heads,
                       num_kv_heads, head_dim, block_size, window, scale, softcap, dtype,
                       cache_kind};
    const int64_t num_tokens = num_reqs > 0 ? query_start_loc[num_reqs] : 0;
    int64_t max_ctx = 1;
    for (int64_t r = 0; r < num_reqs; ++r) {
        const int64_t ctx = window > 0 && seq_lens[r] > window ? window : seq_lens[r];
        max_ctx = ctx > max_ctx ? ctx : max_ctx;
    }
    const int64_t ld = (max_ctx + 7) / 8 * 8, HD = num_heads * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *qb = malloc(sizeof(float) * HD), *acc = malloc(sizeof(float) * HD);
        float *p = malloc(sizeof(float) * num_heads * ld), *row = malloc(sizeof(float) * head_dim);
        const int ok = qb && acc && p && row;
#pragma omp for schedule(dynamic, 4)
        for (int64_t token = 0; token < num_tokens; ++token)
            if (ok) kvq_attend(&a, token, qb, acc, p, ld, row);
        failed |= !ok;
        free(qb); free(acc); free(p); free(row);
    }
    return failed;
}
