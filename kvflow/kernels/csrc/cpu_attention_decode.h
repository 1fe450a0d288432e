/*
 * Decode attention of one query token (every head) for head_dim % 16 == 0, included by
 * cpu_attention.c: the two-pass method of attend_token (pass 1 scores every visible key of
 * every head, the softmax is taken over the whole context at once, pass 2 sums the value rows),
 * with 16-lane vectors and the heads of a GQA group computed together:
 *
 *   - K and V rows are read in place from the cache and widened to fp32 in registers (bf16:
 *     a shift; fp16: a conversion), never copied to a scratch block first;
 *   - each key vector loaded serves up to four query heads of its KV head's group, and four
 *     keys are scored at once, so one load feeds four FMA chains and the 16-lane sums of the
 *     four keys' dot products reduce together (a 4 x 4 transpose-and-add, sum8x4);
 *   - each value vector serves up to four heads too, the heads' outputs (up to 4 x 64
 *     columns) held in registers across a block's keys.
 *
 *   - a request's K blocks are prefetched into L2 when it starts, each V block while its K block
 *     is scored, and the next request's first K blocks before the softmax: a decode step's
 *     K/V come from memory (other layers evict them), from blocks scattered in the cache.
 *
 * On the 2-core AVX512 EPYC of issue 23 (SmolLM2's 9 query / 3 KV heads of 64, 64 requests of
 * 129-192 keys, K/V read from memory, one thread, load ~8) the step took 0.85-0.89x the time
 * of attend_token (bf16 ~1.6 ms, fp32 ~2.1 ms; benchmarks/cpu_decode_attention.py): it is
 * memory-bound there (~5-6 GB/s, what one core streamed on that loaded machine). On the 2-core
 * AVX2 EPYC (Zen 3) the same step with 8-lane vectors takes fp32 ~2.0 ms, bf16 ~1.9 ms, one
 * thread, 0.30x the time of the 16-lane code compiled for AVX2 (whose accumulators spilled).
 * Sums run in an order fixed by the token's position alone (keys grouped by cache block, four
 * at a time), as batch-invariant mode requires.
 */
#ifndef KVFLOW_CPU_ATTENTION_DECODE_H
#define KVFLOW_CPU_ATTENTION_DECODE_H

/* The decode vector: 16 lanes (one zmm) with AVX-512, else 8 (one ymm). The register budget
 * sets the query heads per pass over a KV head's rows (DEC_G) and the value columns held per
 * head (DEC_COLS): AVX-512 has 32 vector registers, AVX2 16, and 16-lane vectors on AVX2 (two
 * ymm each) spilled the accumulators to the stack (3.3x slower on the AVX2 EPYC of issue 23).
 * dload(dtype, base, i): one vector of `base` (storage dtype) from element i, widened to fp32
 * (dwiden: from bf16 / fp16); dfold(a): its lanes folded to 8 (AVX-512: the two halves added). */
#if defined(__AVX512F__)
#include <immintrin.h>

typedef float dvec __attribute__((vector_size(64)));
enum { DEC_G = 4, DEC_COLS = 64 };

static inline __attribute__((always_inline)) dvec dwiden(int dtype, const void *base,
                                                          int64_t i) {
    dvec f;
    /* one zero-extending load (VPMOVZXWD) and a shift; fp16: VCVTPH2PS */
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    const __m512 wide = dtype == DT_BF16
        ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        : _mm512_cvtph_ps(h);
    memcpy(&f, &wide, sizeof f);
    return f;
}

static inline v8f dfold(dvec a) {
    v8f lo, hi;
    memcpy(&lo, &a, sizeof lo);
    memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
    return lo + hi;
}
#else
typedef v8f dvec;
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef _Float16 v8h __attribute__((vector_size(16)));
enum { DEC_G = 3, DEC_COLS = 32 };

static inline __attribute__((always_inline)) dvec dwiden(int dtype, const void *base,
                                                          int64_t i) {
    dvec f;
    if (dtype == DT_BF16) {
        v8u16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        const v8u32 u = __builtin_convertvector(h, v8u32) << 16;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    v8h h;
    memcpy(&h, (const _Float16 *)base + i, sizeof h);
    return __builtin_convertvector(h, dvec);
}

static inline v8f dfold(dvec a) { return a; }
#endif
enum { DV = sizeof(dvec) / sizeof(float), DEC_COL_VECS = DEC_COLS / DV };

static inline __attribute__((always_inline)) dvec dload(int dtype, const void *base,
                                                         int64_t i) {
    if (dtype != DT_F32) return dwiden(dtype, base, i);
    dvec f;
    memcpy(&f, (const float *)base + i, sizeof f);
    return f;
}

/* s[g * ld + t] = q[g * D : (g + 1) * D] . key t, for G query rows and the n keys whose rows
 * start at element t * row of `k` (storage dtype). Four keys at a time, then one. */
static inline __attribute__((always_inline)) void dec_scores(int dtype, int G, const float *q,
                                                             const void *k, int64_t row,
                                                             int64_t n, int64_t D, float *s,
                                                             int64_t ld) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        dvec acc[DEC_G][4];
        for (int g = 0; g < G; ++g)
            for (int u = 0; u < 4; ++u) acc[g][u] = (dvec){0};
        for (int64_t c = 0; c < D; c += DV) {
            dvec kv[4];
            for (int u = 0; u < 4; ++u) kv[u] = dload(dtype, k, (t + u) * row + c);
            for (int g = 0; g < G; ++g) {
                dvec qv;
                memcpy(&qv, q + g * D + c, sizeof qv);
                for (int u = 0; u < 4; ++u) acc[g][u] += qv * kv[u];
            }
        }
        for (int g = 0; g < G; ++g) {
            const v4f sums = sum8x4(dfold(acc[g][0]), dfold(acc[g][1]), dfold(acc[g][2]),
                                    dfold(acc[g][3]));
            memcpy(s + g * ld + t, &sums, sizeof sums);
        }
    }
    for (; t < n; ++t) {
        dvec acc[DEC_G];
        for (int g = 0; g < G; ++g) acc[g] = (dvec){0};
        for (int64_t c = 0; c < D; c += DV) {
            const dvec kv = dload(dtype, k, t * row + c);
            for (int g = 0; g < G; ++g) {
                dvec qv;
                memcpy(&qv, q + g * D + c, sizeof qv);
                acc[g] += qv * kv;
            }
        }
        for (int g = 0; g < G; ++g) s[g * ld + t] = sum8(dfold(acc[g]));
    }
}

/* o[g * D + c] += sum_t p[g * ld + t] * value t [c], for G rows and the n values whose rows
 * start at element t * row of `v`; DEC_COLS columns of the outputs at a time, then one vector,
 * held in registers across the keys. */
static inline __attribute__((always_inline)) void dec_pv(int dtype, int G, const float *p,
                                                         int64_t ld, const void *v,
                                                         int64_t row, int64_t n, int64_t D,
                                                         float *o) {
    int64_t c = 0;
    for (; c + DEC_COLS <= D; c += DEC_COLS) {
        dvec acc[DEC_G][DEC_COL_VECS];
        for (int g = 0; g < G; ++g)
            for (int u = 0; u < DEC_COL_VECS; ++u)
                memcpy(&acc[g][u], o + g * D + c + DV * u, sizeof(dvec));
        for (int64_t t = 0; t < n; ++t) {
            dvec vv[DEC_COL_VECS];
            for (int u = 0; u < DEC_COL_VECS; ++u) vv[u] = dload(dtype, v, t * row + c + DV * u);
            for (int g = 0; g < G; ++g) {
                const float pg = p[g * ld + t];
                for (int u = 0; u < DEC_COL_VECS; ++u) acc[g][u] += pg * vv[u];
            }
        }
        for (int g = 0; g < G; ++g)
            for (int u = 0; u < DEC_COL_VECS; ++u)
                memcpy(o + g * D + c + DV * u, &acc[g][u], sizeof(dvec));
    }
    for (; c < D; c += DV) {
        dvec acc[DEC_G];
        for (int g = 0; g < G; ++g) memcpy(&acc[g], o + g * D + c, sizeof(dvec));
        for (int64_t t = 0; t < n; ++t) {
            const dvec vv = dload(dtype, v, t * row + c);
            for (int g = 0; g < G; ++g) acc[g] += p[g * ld + t] * vv;
        }
        for (int g = 0; g < G; ++g) memcpy(o + g * D + c, &acc[g], sizeof(dvec));
    }
}

/* Ask for `bytes` from p to be brought into L2 (blocks are scattered in memory, so the hardware
 * prefetcher cannot guess them; L1 is too small for a request's keys and values). */
static inline void prefetch_l2(const char *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* One pass's work on one block for G (1..4, a compile-time constant after inlining) query
 * heads of one KV head, per storage dtype: pass 0 scores, pass 1 values. */
static inline __attribute__((always_inline)) void dec_block(int pass, int dtype, int G,
                                                            const float *q, float *p,
                                                            int64_t ld, const void *rows,
                                                            int64_t row, int64_t n, int64_t D,
                                                            float *o) {
    if (pass == 0) dec_scores(dtype, G, q, rows, row, n, D, p, ld);
    else dec_pv(dtype, G, p, ld, rows, row, n, D, o);
}

#define DEC_DTYPES(G)                                                                       \
    do {                                                                                    \
        if (dtype == DT_BF16) dec_block(pass, DT_BF16, G, q, p, ld, rows, row, n, D, o);   \
        else if (dtype == DT_F16) dec_block(pass, DT_F16, G, q, p, ld, rows, row, n, D, o); \
        else dec_block(pass, DT_F32, G, q, p, ld, rows, row, n, D, o);                     \
    } while (0)

static void dec_heads(int pass, int dtype, int G, const float *q, float *p, int64_t ld,
                      const void *rows, int64_t row, int64_t n, int64_t D, float *o) {
    switch (G) {
    case 1: DEC_DTYPES(1); break;
    case 2: DEC_DTYPES(2); break;
    case 3: DEC_DTYPES(3); break;
    default: DEC_DTYPES(DEC_G); break; /* G == DEC_G */
    }
}
#undef DEC_DTYPES

/* Attention of query token j of request r, all heads (same contract and summation order
 * rules as attend_token in cpu_attention.c), for head_dim % 16 == 0. */
static void attend_token_vec(const Args *a, Scratch *w, int64_t r, int64_t j) {
    const int64_t D = a->head_dim, bs = a->block_size, H = a->num_heads, Hkv = a->num_kv_heads;
    const int64_t group = H / Hkv, row = Hkv * D, ld = w->p_stride;
    const size_t es = elem_size(a->dtype), block_bytes = bs * row * es;
    const int64_t qlen = a->query_start_loc[r + 1] - a->query_start_loc[r];
    const int64_t q0 = a->query_start_loc[r] + j, pos = a->seq_lens[r] - qlen + j;
    const int64_t lo = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    load_queries(a, w, q0, 1);
    memset(w->acc, 0, sizeof(float) * H * D);
    for (int64_t b = lo / bs; b * bs <= pos; ++b) /* every K block, into L2 */
        prefetch_l2(a->k_cache + bt[b] * block_bytes, block_bytes);
    for (int pass = 0; pass < 2; ++pass) {
        const char *cache = pass == 0 ? a->k_cache : a->v_cache;
        for (int64_t b = lo / bs; b * bs <= pos; ++b) {
            const int64_t t0 = b * bs > lo ? b * bs : lo;
            const int64_t t1 = pos + 1 < (b + 1) * bs ? pos + 1 : (b + 1) * bs;
            if (pass == 0) /* this block's values, for pass 1 */
                prefetch_l2(a->v_cache + bt[b] * block_bytes, block_bytes);
            const char *blk = cache + ((int64_t)bt[b] * bs + (t0 - b * bs)) * row * es;
            for (int64_t h = 0; h < Hkv; ++h)
                for (int64_t g0 = 0; g0 < group; g0 += DEC_G) {
                    const int G = group - g0 < DEC_G ? (int)(group - g0) : DEC_G;
                    const int64_t hq = h * group + g0;
                    dec_heads(pass, a->dtype, G, w->q + hq * D, w->p + hq * ld + (t0 - lo), ld,
                              blk + h * D * es, row, t1 - t0, D, w->acc + hq * D);
                }
        }
        if (pass == 1) break;
        if (j == 0 && r + 1 < a->num_reqs) /* the next request's first keys: likely next */
            for (int64_t b = 0; b < 2 && b * bs < a->seq_lens[r + 1]; ++b)
                prefetch_l2(a->k_cache + bt[a->bt_stride + b] * block_bytes, block_bytes);
        for (int64_t hq = 0; hq < H; ++hq) {
            soft_cap_scores(w->p + hq * ld, pos + 1 - lo, a->softcap);
            w->l[hq] = exp_shifted(w->p + hq * ld, pos + 1 - lo);
        }
    }
    for (int64_t hq = 0; hq < H; ++hq) {
        const float inv = 1.f / w->l[hq];
        for (int64_t d = 0; d < D; ++d) w->acc[hq * D + d] *= inv;
    }
    store_row(a->dtype, w->acc, a->out + q0 * H * D * es, H * D);
}

#endif
