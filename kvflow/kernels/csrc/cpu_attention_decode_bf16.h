/*
 * Decode attention of one query token over a bf16 cache, for AVX512 builds and head_dim % 32
 * == 0 (included by cpu_attention.c). Same method and contract as attend_token_vec
 * (cpu_attention_decode.h: pass 1 scores every visible key of every head, one softmax over the
 * whole context, pass 2 sums the value rows), with two changes, both for a step whose K/V
 * come from memory (the other layers evict them):
 *
 *   - A bf16 pair in a 32-bit lane widens by two single-cycle ALU operations: the even element
 *     is the lane shifted left by 16, the odd one the lane with its low half cleared. A 64-byte
 *     load of 32 keys' or values' dims thus gives two fp32 vectors (even dims, odd dims) with
 *     no shuffle (the VPMOVZXWD of dload runs on the one shuffle port, which the score sums
 *     also need). The queries are kept with their even and odd dims apart (scaled once), so
 *     q . k = q_even . k_even + q_odd . k_odd; the value sums are kept apart the same way and
 *     interleaved once per token at the end. Products and fp32 sums are the same operations as
 *     widening each element; only the summation order differs.
 *   - Prefetch is a stream kept a fixed distance ahead of the reads: the token's K rows, its V
 *     rows, then the next request's first K rows, as (address, lines) segments; each step of
 *     the score and value loops issues as many line prefetches as it reads, so the core never
 *     stalls on a burst of prefetches waiting for fill buffers (the old code prefetched every
 *     K block of a request at once), and a block is asked for early enough to arrive. The
 *     lines are prefetched into L2 (PREFETCHT2), not L1: a PREFETCHT0 holds one of the few L1
 *     miss buffers until its line arrives, so a stream of them throttles itself, while L2
 *     tracks many more misses. On the 2-core AVX512-BF16 EPYC, 6 KB blocks read in random
 *     order with the stream two blocks ahead: 8.6-10.6 GB/s into L1, 17-21 GB/s into L2
 *     (benchmarks/cpu_kv_bandwidth.c); the kernel's time per call 0.68x (one thread, random
 *     order) to 0.84x (two threads, the engine's block order) of PREFETCHT0's
 *     (benchmarks/cpu_decode_attention.py, docs/benchmarks.md session 12).
 *
 * Four keys' dot products of a query head reduce together (unpack-and-add within 128-bit lanes,
 * then across them). Every sum runs in an order fixed by the token's position alone (keys
 * grouped by cache block, four at a time), as batch-invariant mode requires.
 */
#ifndef KVFLOW_CPU_ATTENTION_DECODE_BF16_H
#define KVFLOW_CPU_ATTENTION_DECODE_BF16_H

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

#define HAVE_DECODE_BF16 1

enum {
    PF_AHEAD_LINES = 192, /* prefetch distance: two 6 KB blocks (SmolLM2's) */
    PF_MAX_SEGS = 512,    /* segments of one token's stream (K and V blocks + the next keys) */
    DB_G = 4,             /* query heads per pass over a KV head's rows */
    DB_NC = 4             /* 32-dim chunks per head: head_dim <= 128 */
};

/* A stream of (address, lines) segments to prefetch, and how far it has been issued. */
typedef struct {
    const char *addr[PF_MAX_SEGS];
    int32_t lines[PF_MAX_SEGS];
    int32_t nseg, seg, line;
} PfStream;

static inline void pf_push(PfStream *s, const char *addr, size_t bytes) {
    if (s->nseg < PF_MAX_SEGS) {
        s->addr[s->nseg] = addr;
        s->lines[s->nseg++] = (int32_t)((bytes + 63) / 64);
    }
}

_Static_assert(sizeof(PfStream) <= PF_SCRATCH_BYTES, "Scratch.pf holds a PfStream");

/* Prefetch the stream's next n lines (fewer at its end) into L2. */
static inline void pf_issue(PfStream *s, int n) {
    while (n > 0 && s->seg < s->nseg) {
        const char *p = s->addr[s->seg];
        int line = s->line;
        const int left = s->lines[s->seg] - line, k = n < left ? n : left;
        for (int i = 0; i < k; ++i) _mm_prefetch(p + 64 * (line + i), _MM_HINT_T2);
        n -= k;
        line += k;
        if (line == s->lines[s->seg]) {
            ++s->seg;
            line = 0;
        }
        s->line = line;
    }
}

/* The four lane sums {sum(a0), sum(a1), sum(a2), sum(a3)}. */
static inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d d0 = _mm512_castps_pd(u0), d1 = _mm512_castps_pd(u1);
    const __m512 v = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
    const __m256 w = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
}

/* The even and odd bf16 elements of a 64-byte load, as fp32. */
static inline __m512 bf16_even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline __m512 bf16_odd(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* s[g * ld + t] = q_g . key t for G query heads (q: per head NC chunks of [16 even | 16 odd]
 * dims, fp32) and the n keys of one KV head whose rows start at k + t * row (bf16 elements);
 * each four keys issue `pf` line prefetches of the stream. */
static inline __attribute__((always_inline)) void db_scores(int G, int NC, const float *q,
                                                            const uint16_t *k, int64_t row,
                                                            int64_t n, float *s, int64_t ld,
                                                            PfStream *ps, int pf) {
    const int64_t D = 32 * NC;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        pf_issue(ps, pf);
        __m512 acc[DB_G][4];
        for (int g = 0; g < G; ++g)
            for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_setzero_ps();
        for (int c = 0; c < NC; ++c) {
            __m512 ke[4], ko[4];
            for (int u = 0; u < 4; ++u) {
                const __m512i x = _mm512_loadu_si512((const void *)(k + (t + u) * row + 32 * c));
                ke[u] = bf16_even(x);
                ko[u] = bf16_odd(x);
            }
            for (int g = 0; g < G; ++g) {
                const __m512 qe = _mm512_loadu_ps(q + g * D + 32 * c);
                const __m512 qo = _mm512_loadu_ps(q + g * D + 32 * c + 16);
                for (int u = 0; u < 4; ++u)
                    acc[g][u] = _mm512_fmadd_ps(qo, ko[u], _mm512_fmadd_ps(qe, ke[u], acc[g][u]));
            }
        }
        for (int g = 0; g < G; ++g)
            _mm_storeu_ps(s + g * ld + t, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    }
    for (; t < n; ++t) {
        __m512 acc[DB_G];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int c = 0; c < NC; ++c) {
            const __m512i x = _mm512_loadu_si512((const void *)(k + t * row + 32 * c));
            const __m512 ke = bf16_even(x), ko = bf16_odd(x);
            for (int g = 0; g < G; ++g)
                acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 32 * c + 16), ko,
                                         _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 32 * c),
                                                         ke, acc[g]));
        }
        for (int g = 0; g < G; ++g) s[g * ld + t] = _mm512_reduce_add_ps(acc[g]);
    }
}

/* o_g += sum_t p[g * ld + t] * value t, for G heads (o: per head NC chunks of [16 even | 16
 * odd] dims) and the n values of one KV head at v + t * row; every four values issue `pf` line
 * prefetches of the stream. The outputs stay in registers across the keys. */
static inline __attribute__((always_inline)) void db_values(int G, int NC, const float *p,
                                                            int64_t ld, const uint16_t *v,
                                                            int64_t row, int64_t n, float *o,
                                                            PfStream *ps, int pf) {
    const int64_t D = 32 * NC;
    __m512 acc[DB_G][2 * DB_NC];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2 * NC; ++c) acc[g][c] = _mm512_loadu_ps(o + g * D + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
        if (t % 4 == 0) pf_issue(ps, pf);
        for (int c = 0; c < NC; ++c) {
            const __m512i x = _mm512_loadu_si512((const void *)(v + t * row + 32 * c));
            const __m512 ve = bf16_even(x), vo = bf16_odd(x);
            for (int g = 0; g < G; ++g) {
                const __m512 pg = _mm512_set1_ps(p[g * ld + t]);
                acc[g][2 * c] = _mm512_fmadd_ps(pg, ve, acc[g][2 * c]);
                acc[g][2 * c + 1] = _mm512_fmadd_ps(pg, vo, acc[g][2 * c + 1]);
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(o + g * D + 16 * c, acc[g][c]);
}

static inline __attribute__((always_inline)) void db_block(int pass, int G, int NC,
                                                           const float *q, float *p, int64_t ld,
                                                           const uint16_t *rows, int64_t row,
                                                           int64_t n, float *o, PfStream *ps,
                                                           int pf) {
    if (pass == 0) db_scores(G, NC, q, rows, row, n, p, ld, ps, pf);
    else db_values(G, NC, p, ld, rows, row, n, o, ps, pf);
}

#define DB_CHUNKS(G)                                                                    \
    do {                                                                                \
        switch (NC) {                                                                   \
        case 1: db_block(pass, G, 1, q, p, ld, rows, row, n, o, ps, pf); break;         \
        case 2: db_block(pass, G, 2, q, p, ld, rows, row, n, o, ps, pf); break;         \
        case 3: db_block(pass, G, 3, q, p, ld, rows, row, n, o, ps, pf); break;         \
        default: db_block(pass, G, 4, q, p, ld, rows, row, n, o, ps, pf); break;        \
        }                                                                               \
    } while (0)

static void db_heads(int pass, int G, int NC, const float *q, float *p, int64_t ld,
                     const uint16_t *rows, int64_t row, int64_t n, float *o, PfStream *ps,
                     int pf) {
    switch (G) {
    case 1: DB_CHUNKS(1); break;
    case 2: DB_CHUNKS(2); break;
    case 3: DB_CHUNKS(3); break;
    default: DB_CHUNKS(4); break;
    }
}
#undef DB_CHUNKS

/* Query token j of request r, all heads, scaled, into w->q as per head NC chunks of [16 even
 * | 16 odd] dims. */
static void db_load_query(const Args *a, Scratch *w, int64_t token) {
    const int64_t HD = a->num_heads * a->head_dim;
    const uint16_t *src = (const uint16_t *)a->q + token * a->q_stride;
    for (int64_t i = 0; i < HD; i += 32)
        for (int64_t e = 0; e < 16; ++e) {
            uint32_t u0 = (uint32_t)src[i + 2 * e] << 16, u1 = (uint32_t)src[i + 2 * e + 1] << 16;
            float f0, f1;
            memcpy(&f0, &u0, 4);
            memcpy(&f1, &u1, 4);
            w->q[i + e] = f0 * a->scale;
            w->q[i + 16 + e] = f1 * a->scale;
        }
}

/* The stream of a decode token's reads: K rows [lo, pos] block by block, V rows likewise, then
 * request r + 1's first two K blocks (likely the next item's first reads). */
static void db_stream(const Args *a, PfStream *s, int64_t r, int64_t lo, int64_t pos) {
    const int64_t bs = a->block_size, row_bytes = a->num_kv_heads * a->head_dim * 2;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    s->nseg = s->seg = s->line = 0;
    for (int pass = 0; pass < 2; ++pass) {
        const char *cache = pass == 0 ? a->k_cache : a->v_cache;
        for (int64_t b = lo / bs; b * bs <= pos; ++b) {
            const int64_t t0 = b * bs > lo ? b * bs : lo;
            const int64_t t1 = pos + 1 < (b + 1) * bs ? pos + 1 : (b + 1) * bs;
            pf_push(s, cache + ((int64_t)bt[b] * bs + t0 - b * bs) * row_bytes,
                    (size_t)((t1 - t0) * row_bytes));
        }
    }
    if (r + 1 < a->num_reqs)
        for (int64_t b = 0; b < 2 && b * bs < a->seq_lens[r + 1]; ++b)
            pf_push(s, a->k_cache + (int64_t)bt[a->bt_stride + b] * bs * row_bytes,
                    (size_t)(bs * row_bytes));
}

/* Attention of query token j of request r, all heads, bf16 cache (same contract and summation
 * order rules as attend_token in cpu_attention.c), for head_dim % 32 == 0, <= 128. */
static void attend_token_bf16(const Args *a, Scratch *w, int64_t r, int64_t j) {
    const int64_t D = a->head_dim, bs = a->block_size, H = a->num_heads, Hkv = a->num_kv_heads;
    const int64_t group = H / Hkv, row = Hkv * D, ld = w->p_stride;
    const int NC = (int)(D / 32);
    const int64_t qlen = a->query_start_loc[r + 1] - a->query_start_loc[r];
    const int64_t q0 = a->query_start_loc[r] + j, pos = a->seq_lens[r] - qlen + j;
    const int64_t lo = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    /* lines read per four rows of one KV head: what each step of the loops prefetches */
    const int pf = (int)((4 * D * 2 + 63) / 64);
    PfStream *ps = (PfStream *)w->pf;
    db_stream(a, ps, r, lo, pos);
    pf_issue(ps, PF_AHEAD_LINES);
    db_load_query(a, w, q0);
    memset(w->acc, 0, sizeof(float) * H * D);
    for (int pass = 0; pass < 2; ++pass) {
        const char *cache = pass == 0 ? a->k_cache : a->v_cache;
        for (int64_t b = lo / bs; b * bs <= pos; ++b) {
            const int64_t t0 = b * bs > lo ? b * bs : lo;
            const int64_t t1 = pos + 1 < (b + 1) * bs ? pos + 1 : (b + 1) * bs;
            const uint16_t *blk = (const uint16_t *)cache + ((int64_t)bt[b] * bs + t0 - b * bs)
                                                            * row;
            for (int64_t h = 0; h < Hkv; ++h)
                for (int64_t g0 = 0; g0 < group; g0 += DB_G) {
                    const int G = group - g0 < DB_G ? (int)(group - g0) : DB_G;
                    const int64_t hq = h * group + g0;
                    db_heads(pass, G, NC, w->q + hq * D, w->p + hq * ld + (t0 - lo), ld,
                             blk + h * D, row, t1 - t0, w->acc + hq * D, ps,
                             g0 == 0 ? pf : 0);
                }
        }
        if (pass == 0)
            for (int64_t hq = 0; hq < H; ++hq) {
                soft_cap_scores(w->p + hq * ld, pos + 1 - lo, a->softcap);
                w->l[hq] = exp_shifted(w->p + hq * ld, pos + 1 - lo);
            }
    }
    /* normalize, interleave the even and odd dims back, round to bf16 */
    float *o = w->acc + H * D; /* acc holds TILE * H * D floats */
    for (int64_t hq = 0; hq < H; ++hq) {
        const float inv = 1.f / w->l[hq];
        const float *acc = w->acc + hq * D;
        for (int64_t i = 0; i < D; i += 32)
            for (int64_t e = 0; e < 16; ++e) {
                o[hq * D + i + 2 * e] = acc[i + e] * inv;
                o[hq * D + i + 2 * e + 1] = acc[i + 16 + e] * inv;
            }
    }
    store_row(DT_BF16, o, a->out + q0 * H * D * 2, H * D);
}

#else
#define HAVE_DECODE_BF16 0
static void attend_token_bf16(const Args *a, Scratch *w, int64_t r, int64_t j) {
    attend_token_vec(a, w, r, j);
}
#endif

#endif
