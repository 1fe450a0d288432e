/*
 * Paged attention for a mixed batch on CPU (kvflow's "cpu" attention backend).
 *
 * Reads K/V in place through the block table (no gather copy) and computes, for every query
 * token, softmax(q . K^T * scale) V over its causal (optionally sliding-window) context with an
 * online softmax over one KV block at a time (Milakov & Gimelshein, "Online normalizer
 * calculation for softmax", 2018; the FlashAttention recurrence, Dao et al., 2022).
 *
 * Layouts (row-major; elements of the storage dtype):
 *   q           [num_tokens, num_heads, head_dim]   (token stride q_stride, heads contiguous)
 *   k/v_cache   [num_blocks, block_size, num_kv_heads, head_dim]
 *   out         [num_tokens, num_heads, head_dim]   (contiguous)
 *   block_table int32 [num_reqs, bt_stride]; query_start_loc int32 [num_reqs + 1];
 *   seq_lens    int32 [num_reqs], context length after this step (tokens).
 * Query token j of request r sits at position seq_lens[r] - query_len + j and sees the keys in
 * (pos - window, pos] (window <= 0: all of [0, pos]). Query head i reads KV head
 * i / (num_heads / num_kv_heads) (GQA). Accumulation is fp32 for every storage dtype.
 *
 * Work item = (request, tile of up to TILE query tokens) with all its heads: the item walks the
 * request's blocks in order, reading each block (every KV head, contiguous in memory) once, and
 * each K/V row serves every query token of the tile and every query head of its GQA group.
 * Batch-invariant mode (tiled = 3, kvflow's --deterministic) instead makes every query token
 * its own item and runs it through the decode path (attend_token): a token's result then
 * depends only on its query, its position and the cache contents, never on the other tokens
 * of its chunk, how the prompt was chunked, or the other requests of the batch (He et al.,
 * "Defeating Nondeterminism in LLM Inference", Thinking Machines 2025, ask the same of
 * attention: one reduction order per query, whatever the batch).
 * Items run on OpenMP threads of the libgomp runtime torch has already loaded, so the two share
 * one pool. The caller guarantees the indices are in range (kvflow checks them once per step).
 */
#include "cpu_common.h"
#include "cpu_entry_points.h"
#include "cpu_pool.h"

#include <stdint.h>

#define TILE 16
#define BATCH_INVARIANT 3

enum { SB = 64, MR_T = 6 }; /* keys per super-block and rows per register tile (tiled path) */
enum { SB_DP = 128 }; /* keys per super-block of the bf16 dot-product path (>= SB) */
enum { PF_SCRATCH_BYTES = 8192 }; /* >= sizeof(PfStream), checked where it is defined */

typedef struct {
    const char *q, *k_cache, *v_cache;
    char *out;
    const int32_t *block_table, *query_start_loc, *seq_lens;
    int64_t q_stride, bt_stride, num_heads, num_kv_heads, head_dim, block_size, window;
    float scale, softcap; /* softcap > 0: scores soft-capped (soft_cap_scores), else none */
    int dtype;
    int64_t num_reqs;
} Args;

/* Per-thread scratch: fp32 query rows, a block of scores per row, softmax state (m, l, and
 * corr: the block's rescale factor) and accumulators (rows = TILE * num_heads), one K and V
 * block of every KV head converted to fp32 (unused for fp32 caches), row pointers into the
 * block (k, v: every head; kh, vh: one), and for decode items every head's scores over the
 * longest context of the call (p); for tiled prefill items the tile's transposed queries (qt,
 * or bf16 pairs on the dot-product path), the packed P and V of a super-block (pp, vpk: that
 * path only), one KV head's scores over a super-block of keys (st) and their max per row (mx:
 * that path only). */
typedef struct {
    float *q, *s, *m, *l, *corr, *acc, *kb, *vb, *p, *qt, *st, *mx;
    const float **k, **v, **kh, **vh;
    const char **kp, **vp, **qrow; /* tiled path: key / value rows, operand rows */
    int32_t *pp, *vpk; /* bf16 dot-product path: P and V of a super-block in pairs */
    void *pf; /* bf16 decode path: its prefetch stream (PfStream, cpu_attention_decode_bf16.h) */
    int64_t p_stride; /* floats per head row of p: a decode request's scores (max context) */
} Scratch;

static int scratch_alloc(Scratch *w, int64_t rows, int64_t block_size, int64_t head_dim,
                         int64_t num_kv_heads, int64_t num_heads, int64_t max_decode_ctx) {
    w->p_stride = (max_decode_ctx + 7) / 8 * 8;
    w->p = malloc(sizeof(float) * (num_heads * w->p_stride > 0 ? num_heads * w->p_stride : 1));
    w->q = malloc(sizeof(float) * rows * head_dim);
    w->s = malloc(sizeof(float) * rows * block_size);
    w->m = malloc(sizeof(float) * rows);
    w->corr = malloc(sizeof(float) * rows);
    w->l = malloc(sizeof(float) * rows);
    w->acc = malloc(sizeof(float) * rows * head_dim);
    w->kb = malloc(sizeof(float) * block_size * num_kv_heads * head_dim);
    w->vb = malloc(sizeof(float) * block_size * num_kv_heads * head_dim);
    w->k = malloc(sizeof(float *) * block_size * num_kv_heads);
    w->v = malloc(sizeof(float *) * block_size * num_kv_heads);
    w->kh = malloc(sizeof(float *) * block_size);
    w->vh = malloc(sizeof(float *) * block_size);
    /* tiled paths: rows of one KV head padded to 16; keys of a super-block (SB_DP >= SB) */
    const int64_t ld = (TILE * (num_heads / num_kv_heads) + 15) / 16 * 16;
    const int64_t keys = block_size >= SB_DP ? block_size : SB_DP / block_size * block_size;
    w->qt = malloc(sizeof(float) * num_kv_heads * head_dim * ld);
    w->st = malloc(sizeof(float) * (keys + 8) * ld); /* + the dot path's padding keys */
    w->mx = malloc(sizeof(float) * ld);
    w->kp = malloc(sizeof(char *) * (keys + 8)); /* + padding keys of the dot path's tiles */
    w->vp = malloc(sizeof(char *) * keys);
    w->qrow = malloc(sizeof(char *) * (head_dim > ld ? head_dim : ld));
    w->pp = malloc(sizeof(int32_t) * (keys + 1) / 2 * ld);
    w->vpk = malloc(sizeof(int32_t) * (keys + 1) / 2 * head_dim);
    w->pf = malloc(PF_SCRATCH_BYTES);
    return w->q && w->s && w->m && w->corr && w->l && w->acc && w->kb && w->vb && w->k && w->v
        && w->kh && w->vh && w->p && w->qt && w->st && w->mx && w->kp && w->vp && w->qrow
        && w->pp && w->vpk && w->pf;
}

static void scratch_free(Scratch *w) {
    free(w->q); free(w->s); free(w->m); free(w->corr); free(w->l); free(w->acc); free(w->kb);
    free(w->vb); free(w->k); free(w->v); free(w->kh); free(w->vh); free(w->p); free(w->qt);
    free(w->st); free(w->mx); free(w->kp); free(w->vp); free(w->qrow); free(w->pp); free(w->vpk);
    free(w->pf);
}

/* q . k over D elements (8 lanes at a time, scalar tail). */
static inline float dot(const float *q, const float *k, int64_t D) {
    const int64_t D8 = D - D % 8;
    v8f acc = {0};
    for (int64_t d = 0; d < D8; d += 8) acc += load8(q + d) * load8(k + d);
    float sum = sum8(acc);
    for (int64_t d = D8; d < D; ++d) sum += q[d] * k[d];
    return sum;
}

/* s[t] = q . k[t] for the n keys of a block; four keys at a time so four independent FMA
 * chains share each load of q. */
static void block_scores(const float *q, const float *const *k, int64_t n, int64_t D,
                         float *s) {
    const int64_t D8 = D - D % 8;
    int64_t t = 0;
    for (; t + 4 <= n && D8 == D; t += 4) {
        const float *k0 = k[t], *k1 = k[t + 1], *k2 = k[t + 2], *k3 = k[t + 3];
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t d = 0; d < D; d += 8) {
            const v8f qd = load8(q + d);
            a0 += qd * load8(k0 + d);
            a1 += qd * load8(k1 + d);
            a2 += qd * load8(k2 + d);
            a3 += qd * load8(k3 + d);
        }
        const v4f sums = sum8x4(a0, a1, a2, a3);
        memcpy(s + t, &sums, sizeof sums);
    }
    for (; t < n; ++t) s[t] = dot(q, k[t], D);
}

/* acc[0:D] = acc * corr + sum_t p[t] v[t]. Columns go 64 at a time with eight accumulator
 * vectors held in registers across the keys (independent FMA chains); the rest 8, then 1. */
static void accumulate_pv(float *acc, float corr, const float *p, const float *const *v,
                          int64_t n, int64_t D) {
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) {
        v8f o[8];
        for (int j = 0; j < 8; ++j) o[j] = load8(acc + c + 8 * j) * corr;
        for (int64_t t = 0; t < n; ++t) {
            const float *vr = v[t] + c;
            for (int j = 0; j < 8; ++j) o[j] += p[t] * load8(vr + 8 * j);
        }
        for (int j = 0; j < 8; ++j) store8(acc + c + 8 * j, o[j]);
    }
    for (; c + 8 <= D; c += 8) {
        v8f o = load8(acc + c) * corr;
        for (int64_t t = 0; t < n; ++t) o += p[t] * load8(v[t] + c);
        store8(acc + c, o);
    }
    for (; c < D; ++c) {
        float o = acc[c] * corr;
        for (int64_t t = 0; t < n; ++t) o += p[t] * v[t][c];
        acc[c] = o;
    }
}

/* One online-softmax step of a row's state (m, l) over a block's n scores s (-inf = not
 * visible): s becomes exp(s - m_new) in place. Returns the factor the row's accumulator must be
 * scaled by before this block's values are added, or -1 when no key of the block is visible
 * (state unchanged, block skipped). */
static float softmax_step(float *s, int64_t n, float *m, float *l) {
    float bmax = -INFINITY;
    for (int64_t t = 0; t < n; ++t) bmax = s[t] > bmax ? s[t] : bmax;
    if (bmax == -INFINITY) return -1.f;
    const float m_new = bmax > *m ? bmax : *m;
    const float corr = exp_nonpos(*m - m_new); /* 0 while m is still -inf */
    float psum = 0.f;
#pragma omp simd reduction(+ : psum)
    for (int64_t t = 0; t < n; ++t) {
        s[t] = exp_nonpos(s[t] - m_new);
        psum += s[t];
    }
    *l = *l * corr + psum;
    *m = m_new;
    return corr;
}

/* Row pointers k/v[t * num_kv_heads + h] to block `phys`'s n tokens, every KV head: into the
 * cache itself for fp32, else to fp32 copies in the scratch. */
static void load_block(const Args *a, Scratch *w, int64_t phys, int64_t n, const float **k,
                       const float **v) {
    const int64_t D = a->head_dim, row = a->num_kv_heads * D; /* elements per token */
    const size_t es = elem_size(a->dtype), first = phys * a->block_size * row * es;
    if (a->dtype == DT_F32) {
        for (int64_t i = 0; i < n * a->num_kv_heads; ++i) {
            k[i] = (const float *)(a->k_cache + first) + i * D;
            v[i] = (const float *)(a->v_cache + first) + i * D;
        }
        return;
    }
    load_row(a->dtype, a->k_cache + first, w->kb, n * row);
    load_row(a->dtype, a->v_cache + first, w->vb, n * row);
    for (int64_t i = 0; i < n * a->num_kv_heads; ++i) {
        k[i] = w->kb + i * D;
        v[i] = w->vb + i * D;
    }
}

/* nq query tokens from `first_token` on, every head, scaled, as fp32 rows of w->q. */
static void load_queries(const Args *a, Scratch *w, int64_t first_token, int64_t nq) {
    const int64_t HD = a->num_heads * a->head_dim;
    const size_t es = elem_size(a->dtype);
    for (int64_t i = 0; i < nq; ++i) {
        float *qi = w->q + i * HD;
        load_row(a->dtype, a->q + (first_token + i) * a->q_stride * es, qi, HD);
        for (int64_t d = 0; d < HD; ++d) qi[d] *= a->scale;
    }
}

static void prefetch_range(const char *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

/* fp32 rows [first, first + n) of block `phys` of one cache (every KV head): the cache itself
 * for fp32, else a converted copy in `buf`. */
static const float *block_rows(const Args *a, const char *cache, int64_t phys, int64_t first,
                               int64_t n, float *buf) {
    const int64_t row = a->num_kv_heads * a->head_dim;
    const char *src = cache + (phys * a->block_size + first) * row * elem_size(a->dtype);
    if (a->dtype == DT_F32) return (const float *)src;
    load_row(a->dtype, src, buf, n * row);
    return buf;
}

/* s[0:n] = softmax numerators exp(s - max s) in place; returns their sum. */
static float exp_shifted(float *s, int64_t n) {
    float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
        s[t] = exp_nonpos(s[t] - mx);
        sum += s[t];
    }
    return sum;
}

/* Ask for block `phys` (K and V, all heads) to be brought into cache while the current one is
 * computed: blocks are scattered in memory, so the hardware prefetcher cannot guess them. */
static void prefetch_block(const Args *a, int64_t phys) {
    const size_t bytes = a->block_size * a->num_kv_heads * a->head_dim * elem_size(a->dtype);
    prefetch_range(a->k_cache + phys * bytes, bytes);
    prefetch_range(a->v_cache + phys * bytes, bytes);
}

/* Attention of query tokens j0 .. j0+nq-1 of request r, all heads. Row R of the scratch is
 * (query token R / num_heads, query head R % num_heads), which reads KV head
 * (R % num_heads) / group. */
static void attend_tile(const Args *a, Scratch *w, int64_t r, int64_t j0, int64_t nq) {
    const int64_t D = a->head_dim, bs = a->block_size, H = a->num_heads, Hkv = a->num_kv_heads;
    const int64_t group = H / Hkv, nrows = nq * H;
    const size_t es = elem_size(a->dtype);
    const int64_t q0 = a->query_start_loc[r], qlen = a->query_start_loc[r + 1] - q0;
    const int64_t first_pos = a->seq_lens[r] - qlen + j0, last_pos = first_pos + nq - 1;
    const int64_t lo = a->window > 0 && first_pos - a->window + 1 > 0
        ? first_pos - a->window + 1 : 0;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    const float **k = w->k, **v = w->v, **kh = w->kh, **vh = w->vh;
    load_queries(a, w, q0 + j0, nq);
    for (int64_t R = 0; R < nrows; ++R) {
        w->m[R] = -INFINITY;
        w->l[R] = 0.f;
    }
    memset(w->acc, 0, sizeof(float) * nrows * D);
    for (int64_t b = lo / bs; b * bs <= last_pos; ++b) {
        const int64_t base = b * bs, n = last_pos + 1 - base < bs ? last_pos + 1 - base : bs;
        if ((b + 1) * bs <= last_pos) prefetch_block(a, bt[b + 1]);
        load_block(a, w, bt[b], n, k, v);
        /* Per KV head, three passes over its rows (query token i, query head hq of its group):
         * scores, softmax steps, value updates. Rows are independent, so each pass is a run of
         * independent work the core overlaps; one row's scores -> max -> exp -> values chain
         * would leave it waiting on latencies. */
        for (int64_t h = 0; h < Hkv; ++h) {
            for (int64_t t = 0; t < n; ++t) {
                kh[t] = k[t * Hkv + h];
                vh[t] = v[t * Hkv + h];
            }
            for (int64_t i = 0; i < nq; ++i) {
                const int64_t pos = first_pos + i;
                const int64_t start = a->window > 0 ? pos - a->window + 1 : 0;
                for (int64_t R = i * H + h * group; R < i * H + (h + 1) * group; ++R) {
                    float *s = w->s + R * bs;
                    block_scores(w->q + R * D, kh, n, D, s);
                    soft_cap_scores(s, n, a->softcap);
                    for (int64_t t = 0; t < n; ++t)
                        if (base + t > pos || base + t < start) s[t] = -INFINITY;
                }
            }
            for (int64_t i = 0; i < nq; ++i)
                for (int64_t R = i * H + h * group; R < i * H + (h + 1) * group; ++R)
                    w->corr[R] = softmax_step(w->s + R * bs, n, w->m + R, w->l + R);
            for (int64_t i = 0; i < nq; ++i)
                for (int64_t R = i * H + h * group; R < i * H + (h + 1) * group; ++R)
                    if (w->corr[R] >= 0.f)
                        accumulate_pv(w->acc + R * D, w->corr[R], w->s + R * bs, vh, n, D);
        }
    }
    for (int64_t R = 0; R < nrows; ++R) {
        float *acc = w->acc + R * D;
        const float inv = w->l[R] > 0.f ? 1.f / w->l[R] : 0.f;
        for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
    }
    store_row(a->dtype, w->acc, a->out + (q0 + j0) * H * D * es, nrows * D);
}

/* Attention of query token j of request r (decode: its single token), all heads, in two
 * passes over its visible keys instead of the block-at-a-time recurrence: pass 1 scores every
 * key for every head into w->p, the softmax is then taken over the whole context at once, and
 * pass 2 sums the value rows. Each pass streams its cache's blocks in order with the next one
 * prefetched, and consecutive dot products and value updates do not depend on each other, so
 * the core overlaps them; the recurrence instead waits on every block's max, exp and rescale.
 * Every sum runs in an order fixed by the token's position alone (keys grouped by cache
 * block), which batch-invariant mode relies on. */
static void attend_token(const Args *a, Scratch *w, int64_t r, int64_t j) {
    const int64_t D = a->head_dim, bs = a->block_size, H = a->num_heads, Hkv = a->num_kv_heads;
    const int64_t group = H / Hkv, row = Hkv * D, ld = w->p_stride;
    const size_t block_bytes = bs * row * elem_size(a->dtype);
    const int64_t qlen = a->query_start_loc[r + 1] - a->query_start_loc[r];
    const int64_t q0 = a->query_start_loc[r] + j, pos = a->seq_lens[r] - qlen + j;
    const int64_t lo = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
    const int32_t *bt = a->block_table + r * a->bt_stride;
    const float **kh = w->kh;
    load_queries(a, w, q0, 1);
    for (int pass = 0; pass < 2; ++pass) {
        const char *cache = pass == 0 ? a->k_cache : a->v_cache;
        for (int64_t b = lo / bs; b * bs <= pos; ++b) {
            const int64_t t0 = b * bs > lo ? b * bs : lo, t1 = pos + 1 < (b + 1) * bs
                ? pos + 1 : (b + 1) * bs;
            if ((b + 1) * bs <= pos) prefetch_range(cache + bt[b + 1] * block_bytes, block_bytes);
            const float *rows = block_rows(a, cache, bt[b], t0 - b * bs, t1 - t0, w->kb);
            for (int64_t h = 0; h < Hkv; ++h) {
                for (int64_t t = 0; t < t1 - t0; ++t) kh[t] = rows + t * row + h * D;
                for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
                    float *p = w->p + hq * ld + (t0 - lo);
                    if (pass == 0) block_scores(w->q + hq * D, kh, t1 - t0, D, p);
                    else accumulate_pv(w->acc + hq * D, 1.f, p, kh, t1 - t0, D);
                }
            }
        }
        if (pass == 1) break;
        for (int64_t hq = 0; hq < H; ++hq) {
            soft_cap_scores(w->p + hq * ld, pos + 1 - lo, a->softcap);
            w->l[hq] = exp_shifted(w->p + hq * ld, pos + 1 - lo);
        }
        memset(w->acc, 0, sizeof(float) * H * D);
    }
    for (int64_t hq = 0; hq < H; ++hq) {
        const float inv = 1.f / w->l[hq];
        for (int64_t d = 0; d < D; ++d) w->acc[hq * D + d] *= inv;
    }
    store_row(a->dtype, w->acc, a->out + q0 * H * D * elem_size(a->dtype), H * D);
}

#include "cpu_attention_tiled.h"
#include "cpu_attention_dp.h"
#include "cpu_attention_decode.h"
#include "cpu_attention_decode_bf16.h"

/* The bf16 dot-product path runs where the build has AVX512-BF16 (path 2 of
 * kvflow_paged_attention, bf16 caches). */
#if defined(__AVX512BF16__)
#define HAVE_DP 1
#else
#define HAVE_DP 0
static void attend_tile_dp(const Args *a, Scratch *w, int64_t r, int64_t j0, int64_t nq) {
    attend_tile_tiled(a, w, r, j0, nq);
}
#endif

/* Index of the request owning tile number `tile` (tile_start is a prefix sum). */
static int64_t find_request(const int64_t *tile_start, int64_t num_reqs, int64_t tile) {
    int64_t lo = 0, hi = num_reqs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Work item `tile` of a call (tile_start: the requests' first tiles, a prefix sum): its
 * request's tile of up to TILE query tokens (1 with tiled = BATCH_INVARIANT) by the path
 * `tiled` selects (see kvflow_paged_attention). */
static void attend_item(const Args *a, Scratch *w, const int64_t *tile_start, int tiled,
                        int64_t tile) {
    const int per_token = tiled == BATCH_INVARIANT, tile_len = per_token ? 1 : TILE;
    const int64_t r = find_request(tile_start, a->num_reqs, tile);
    const int64_t qlen = a->query_start_loc[r + 1] - a->query_start_loc[r];
    const int64_t j0 = (tile - tile_start[r]) * tile_len;
    const int64_t nq = qlen - j0 < tile_len ? qlen - j0 : tile_len;
    if ((per_token || qlen == 1) && HAVE_DECODE_BF16 && a->dtype == DT_BF16
        && a->head_dim % 32 == 0 && a->head_dim <= 128)
        attend_token_bf16(a, w, r, j0);
    else if ((per_token || qlen == 1) && a->head_dim % 16 == 0) attend_token_vec(a, w, r, j0);
    else if (per_token || qlen == 1) attend_token(a, w, r, j0);
    else if (tiled == 2 && HAVE_DP && a->dtype == DT_BF16 && a->head_dim % 16 == 0)
        attend_tile_dp(a, w, r, j0, nq);
    else if (tiled && a->head_dim % 16 == 0) attend_tile_tiled(a, w, r, j0, nq);
    else attend_tile(a, w, r, j0, nq);
}

/* tiled: multi-token items take the register-tiled path where head_dim % 16 == 0 (else, and
 * with tiled = 0, the row-by-row path); tiled = 2 takes the bf16 dot-product tiles
 * (cpu_attention_dp.h) instead for a bf16 cache in AVX512-BF16 builds; tiled = 3
 * (BATCH_INVARIANT) attends every query token alone by the decode path. Returns 0 on success,
 * 1 when scratch memory could not be allocated. */
int kvflow_paged_attention(const void *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, void *out, const int32_t *block_table,
                           int64_t bt_stride, const int32_t *query_start_loc,
                           const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int64_t window, float softcap, int dtype,
                           int num_threads, int tiled) {
    const Args a = {q, k_cache, v_cache, out, block_table, query_start_loc, seq_lens, q_stride,
                    bt_stride, num_heads, num_kv_heads, head_dim, block_size, window, scale,
                    softcap, dtype, num_reqs};
    const int per_token = tiled == BATCH_INVARIANT, tile_len = per_token ? 1 : TILE;
    int64_t *tile_start = malloc(sizeof(int64_t) * (num_reqs + 1));
    if (!tile_start) return 1;
    tile_start[0] = 0;
    for (int64_t r = 0; r < num_reqs; ++r) {
        const int64_t qlen = query_start_loc[r + 1] - query_start_loc[r];
        tile_start[r + 1] = tile_start[r] + (qlen + tile_len - 1) / tile_len;
    }
    const int64_t num_tiles = tile_start[num_reqs];
    int64_t max_decode_ctx = 0; /* the longest visible context of a query run by attend_token */
    for (int64_t r = 0; r < num_reqs; ++r) {
        const int64_t ctx = window > 0 && seq_lens[r] > window ? window : seq_lens[r];
        if ((per_token || query_start_loc[r + 1] - query_start_loc[r] == 1)
            && ctx > max_decode_ctx)
            max_decode_ctx = ctx;
    }
    const int64_t rows = TILE * num_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Scratch w;
        const int ok = scratch_alloc(&w, rows, block_size, head_dim, num_kv_heads, num_heads,
                                     max_decode_ctx);
#pragma omp for schedule(dynamic, 1)
        for (int64_t tile = 0; tile < num_tiles; ++tile)
            if (ok) attend_item(&a, &w, tile_start, tiled, tile);
        failed |= !ok;
        scratch_free(&w);
    }
    free(tile_start);
    return failed;
}

/* Write a step's new K/V rows into the paged cache: row t of k and v ([n, num_kv_heads *
 * head_dim] of the cache's dtype, token strides k_stride / v_stride elements, each row
 * contiguous) to slot slot_mapping[t] of k_cache / v_cache ([num_slots, row_elems],
 * contiguous); a negative slot (padding) is skipped. The same bytes as torch's index_copy_
 * through the slots, with no per-row tensor iteration. Returns 2, having written nothing, when
 * a slot is >= num_slots. */
int kvflow_store_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                    void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t n,
                    int64_t num_slots, int64_t row_elems, int dtype, int num_threads) {
    for (int64_t t = 0; t < n; ++t)
        if (slot_mapping[t] >= num_slots) return 2;
    const size_t es = elem_size(dtype), bytes = (size_t)row_elems * es;
    const int nt = (size_t)n * bytes >= ((size_t)1 << 20) ? num_threads : 1; /* big prefills */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * bytes, (const char *)k + t * k_stride * es, bytes);
        memcpy((char *)v_cache + slot * bytes, (const char *)v + t * v_stride * es, bytes);
    }
    return 0;
}

/* The call as a job of kvflow's pool (cpu_pool.h): item = tile. A worker attends its tile into
 * its scratch (its own Scratch allocated per item) and commits the tile's output rows; the
 * caller attends in place with one Scratch. q, the index arrays and tile_start are pool
 * copies, the cache must outlive the pool's use of it. */
typedef struct {
    Args a;
    const int64_t *tile_start;
    int64_t rows, max_decode_ctx;
    Scratch *caller;
    int tiled;
} PooledAttention;

static int64_t tile_first_token(const PooledAttention *pa, int64_t tile, int64_t *nq) {
    const int tile_len = pa->tiled == BATCH_INVARIANT ? 1 : TILE;
    const int64_t r = find_request(pa->tile_start, pa->a.num_reqs, tile);
    const int64_t q0 = pa->a.query_start_loc[r], qlen = pa->a.query_start_loc[r + 1] - q0;
    const int64_t j0 = (tile - pa->tile_start[r]) * tile_len;
    *nq = qlen - j0 < tile_len ? qlen - j0 : tile_len;
    return q0 + j0;
}

static int pooled_attention_item(const void *ctx, int64_t tile, float *scratch) {
    const PooledAttention *pa = ctx;
    if (!scratch) {
        attend_item(&pa->a, pa->caller, pa->tile_start, pa->tiled, tile);
        return 0;
    }
    int64_t nq;
    const int64_t t0 = tile_first_token(pa, tile, &nq);
    const size_t row = (size_t)(pa->a.num_heads * pa->a.head_dim) * elem_size(pa->a.dtype);
    Args a = pa->a; /* the tile's output rows land at the start of scratch */
    a.out = (char *)((uintptr_t)scratch - (uintptr_t)t0 * row);
    Scratch w;
    const int ok = scratch_alloc(&w, pa->rows, a.block_size, a.head_dim, a.num_kv_heads,
                                 a.num_heads, pa->max_decode_ctx);
    if (ok) attend_item(&a, &w, pa->tile_start, pa->tiled, tile);
    scratch_free(&w);
    return !ok;
}

static void pooled_attention_commit(const void *ctx, int64_t tile, const float *scratch) {
    const PooledAttention *pa = ctx;
    int64_t nq;
    const int64_t t0 = tile_first_token(pa, tile, &nq);
    const size_t row = (size_t)(pa->a.num_heads * pa->a.head_dim) * elem_size(pa->a.dtype);
    memcpy(pa->a.out + t0 * row, scratch, (size_t)nq * row);
}

/* kvflow_paged_attention (same arguments, plus the block table's columns bt_cols; the same
 * result, bit for bit) on a pool instead of OpenMP threads. Falls back to kvflow_paged_attention when the pool is NULL or busy, a worker is
 * still inside an earlier job (it may read the index buffer this call would overwrite), a
 * tile's output exceeds a worker's scratch, or memory runs out. */
int kvflow_paged_attention_pooled(KvflowPool *pool, const void *q, int64_t q_stride,
                                  const void *k_cache, const void *v_cache, void *out,
                                  const int32_t *block_table, int64_t bt_stride,
                                  int64_t bt_cols, const int32_t *query_start_loc,
                                  const int32_t *seq_lens, int64_t num_reqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int64_t window, float softcap, int dtype,
                                  int num_threads, int tiled) {
    const size_t es = elem_size(dtype), row = (size_t)(num_heads * head_dim) * es;
    const int tile_len = tiled == BATCH_INVARIANT ? 1 : TILE;
    const int64_t tokens = num_reqs > 0 ? query_start_loc[num_reqs] : 0;
    const size_t idx_bytes = sizeof(int32_t) * (size_t)(num_reqs + 1 + num_reqs
                                                         + num_reqs * bt_cols);
    const size_t tiles_at = (idx_bytes + 7) / 8 * 8;
    int taken = 0;
    char *qc = NULL, *idx = NULL;
    if ((size_t)tile_len * row <= POOL_SCRATCH_FLOATS * sizeof(float) && num_reqs > 0
        && (taken = kvflow_pool_begin(pool)) && kvflow_pool_late_workers(pool) == 0) {
        qc = kvflow_pool_buffer(pool, 0, (size_t)tokens * row + 64);
        idx = kvflow_pool_buffer(pool, 2, tiles_at + sizeof(int64_t) * (num_reqs + 1));
    }
    if (!qc || !idx) {
        if (taken) kvflow_pool_end(pool);
        return kvflow_paged_attention(q, q_stride, k_cache, v_cache, out, block_table, bt_stride,
                                      query_start_loc, seq_lens, num_reqs, num_heads,
                                      num_kv_heads, head_dim, block_size, scale, window,
                                      softcap, dtype, num_threads, tiled);
    }
    for (int64_t t = 0; t < tokens; ++t)
        memcpy(qc + t * row, (const char *)q + t * q_stride * es, row);
    int32_t *qsl = (int32_t *)idx, *sl = qsl + num_reqs + 1, *bt = sl + num_reqs;
    memcpy(qsl, query_start_loc, sizeof(int32_t) * (num_reqs + 1));
    memcpy(sl, seq_lens, sizeof(int32_t) * num_reqs);
    for (int64_t r = 0; r < num_reqs; ++r)
        memcpy(bt + r * bt_cols, block_table + r * bt_stride, sizeof(int32_t) * bt_cols);
    int64_t *tile_start = (int64_t *)(idx + tiles_at), max_decode_ctx = 0;
    tile_start[0] = 0;
    for (int64_t r = 0; r < num_reqs; ++r) {
        const int64_t qlen = qsl[r + 1] - qsl[r];
        const int64_t ctx = window > 0 && sl[r] > window ? window : sl[r];
        tile_start[r + 1] = tile_start[r] + (qlen + tile_len - 1) / tile_len;
        if ((tiled == BATCH_INVARIANT || qlen == 1) && ctx > max_decode_ctx) max_decode_ctx = ctx;
    }
    Scratch caller;
    int failed = !scratch_alloc(&caller, TILE * num_heads, block_size, head_dim, num_kv_heads,
                                num_heads, max_decode_ctx);
    if (!failed) {
        const PooledAttention pa = {
            {qc, k_cache, v_cache, out, bt, qsl, sl, num_heads * head_dim, bt_cols, num_heads,
             num_kv_heads, head_dim, block_size, window, scale, softcap, dtype, num_reqs},
            tile_start, TILE * num_heads, max_decode_ctx, &caller, tiled};
        failed = kvflow_pool_run(pool, pooled_attention_item, pooled_attention_commit, &pa,
                                 sizeof pa, (int64_t)((tile_len * row + 3) / 4),
                                 tile_start[num_reqs]);
    }
    scratch_free(&caller);
    kvflow_pool_end(pool);
    return failed;
}
